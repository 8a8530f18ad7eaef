"""Run several swarm steps at once and hand their results over as they come, late ones apart.

``SwarmBackend.step_many`` starts every session's step on the client's I/O loop in one iteration (so
bundled steps still travel together) and finishes each in the calling thread (LM head). The steps of one
batch normally answer within milliseconds of each other — the servers batch them — and are handed over
together. A step still running ``late_after(first)`` after the first answer came is *late* (its server is
frozen, its session is failing over, its replica is far slower): the ones done so far are handed over
without it, and each late one follows as it completes, so one bad server delays only its own sessions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from swarm_client import runtime

__all__ = ["LATE_FACTOR", "LATE_MIN_S", "late_after", "run_steps"]

R = TypeVar("R")

#: a step still running this long after the first of its batch answered is late: at least ``LATE_MIN_S``,
#: or ``LATE_FACTOR`` × the time that first answer took (a slow model's steps are not late for being slow)
LATE_MIN_S = 0.05
LATE_FACTOR = 1.0


def late_after(first_answer_s: float) -> float:
    """How long after the first answer of a batch its other steps may come before they count as late."""
    return max(LATE_MIN_S, LATE_FACTOR * first_answer_s)


def run_steps(
    steps: Mapping[int, Callable[[], Coroutine[Any, Any, Any]]],
    finish: Callable[[int, Any], R],
    on_ready: Callable[[list[tuple[int, R]]], None] | None = None,
    early: list[tuple[int, R]] | None = None,
) -> dict[int, R]:
    """Run ``steps[i]()`` concurrently on the I/O loop; ``finish(i, output or exception)`` each in this
    thread as it answers. Returns every ``finish`` result. With ``on_ready``, once steps are late, the ones
    finished so far (and ``early``, results known before any step) are handed to it, then each late one as
    it completes — except the last ones, which are only returned."""
    inbox: queue.SimpleQueue[list[tuple[int, Any]]] = queue.SimpleQueue()

    def outcome(task: asyncio.Future) -> Any:
        return asyncio.CancelledError() if task.cancelled() else task.exception() or task.result()

    async def step_all() -> None:
        """On the I/O loop: start every step in this iteration (bundled steps travel together), then put
        what answered into ``inbox`` in groups — the first answers and those within ``late_after``, then
        each late one — so this thread wakes once per group, as it would for one ``gather``."""
        started = asyncio.get_running_loop().time()
        index = {asyncio.ensure_future(step()): i for i, step in steps.items()}
        done, pending = await asyncio.wait(index, return_when=asyncio.FIRST_COMPLETED)
        if pending:
            first_s = asyncio.get_running_loop().time() - started
            more, pending = await asyncio.wait(pending, timeout=late_after(first_s))
            done |= more
        while True:
            inbox.put([(index[t], outcome(t)) for t in done])
            if not pending:
                return
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)

    results: dict[int, R] = {}
    unsent = list(early or [])  # finished, not handed to on_ready
    left = set(steps)
    outer = asyncio.run_coroutine_threadsafe(step_all(), runtime.get_loop())
    while left:
        arrived = _next_group(inbox, outer)
        if arrived is None:  # the I/O loop failed: every step left did
            error = outer.exception() or RuntimeError("the swarm steps ended without an answer")
            arrived = [(i, error) for i in left]
        for i, out in arrived:
            if i in left:
                left.discard(i)
                results[i] = finish(i, out)
                unsent.append((i, results[i]))
        if on_ready is not None and unsent and left:
            on_ready(unsent)  # the rest are late: these go on without them
            unsent = []
    return results


def _next_group(inbox: queue.SimpleQueue, outer: concurrent.futures.Future) -> list[tuple[int, Any]] | None:
    """The next group of answers, or None once ``outer`` (the steps' coroutine) ended with nothing left."""
    while True:
        try:
            return inbox.get(timeout=0.5)
        except queue.Empty:
            if outer.done() and inbox.empty():
                return None
