"""One decode step for all the choices decoding at once: one thread hand-off per cycle instead of two per choice.

Each choice's decode loop (``Engine.run_choice``) used to run its next step in a worker thread of its own:
wake the thread, embed, step the swarm, run the LM head, sample, hand the token back to the event loop.
That is ≈ 1.5 ms of Python per choice and token, and with N concurrent choices all of it falls at the same
moment of the cycle — right after the servers answer — serialized on the gateway's GIL (≈ 12 ms at 8
streams, a sixth of the cycle). ``StepGatherer`` collects the steps the choices submit within a few
event-loop iterations and runs them as one call in one worker thread; the swarm backend's ``step_many``
then runs all their swarm steps concurrently on the client's I/O loop (the servers batch them as before)
and finishes each session exactly as ``step`` would. Results are identical to stepping one by one.

Choices come back at slightly different times (each first emits its text), so after a result the gatherer
*expects* that choice back and waits for the expected ones — a few loop iterations, at most
``GATHER_SECONDS`` — before it sends the next batch. A choice that finishes is forgotten.

A batch is not all-or-nothing: ``run_batch`` gets a ``deliver`` callback and hands over results as they are
ready, so a step that is late (its server frozen, its session failing over) holds up only its own choice.
The others come back, are expected, and go on in the next batches while the late step completes — its
result is delivered whenever it comes, and its choice then joins whatever batch is gathering.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Executor
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

#: event-loop iterations to yield after the last arrival; the longest a batch waits for expected choices
GATHER_PASSES = 3
GATHER_SECONDS = 0.005


class _Group:
    """One group's gathering state: its queued items, the keys it expects back, its batch being gathered."""

    def __init__(self) -> None:
        self.pending: list[tuple[Hashable, Any, asyncio.Future]] = []
        #: keys whose result was delivered and whose next item has not come yet
        self.expected: set[Hashable] = set()
        self.flush_task: asyncio.Task | None = None
        #: set when an item arrives while a batch is gathering (made per batch: engines outlive event loops in tests)
        self.arrived: asyncio.Event | None = None


#: ``deliver(pairs)``: results ready before the batch is done, as (index in the batch, result or exception)
Deliver = Callable[[Iterable[tuple[int, Any]]], None]


class StepGatherer(Generic[T, R]):
    """Gathers items submitted on one event loop into batches for ``run_batch(items, deliver)`` (run in
    ``executor``), which returns one result or exception per item and may hand any of them over earlier
    through ``deliver`` (thread-safe; what it delivered is not delivered again). Batches may overlap: a
    latecomer does not wait for the batch in flight, nor does anyone wait for a batch's late items.

    Items of different *groups* never share a batch, and a group's batch waits only for its own keys: the
    client's pipeline groups (``ClientConfig.pipeline_groups``) then stay apart all the way, so the first
    server computes one group while the next server computes the other, instead of every batch returning
    only when its slowest group has passed the whole chain."""

    def __init__(self, executor: Executor, run_batch: Callable[[Sequence[T], Deliver], Sequence[Any]]):
        self._executor = executor
        self._run_batch = run_batch
        self._groups: dict[Hashable, _Group] = {}
        self.batches = 0
        self.items = 0

    def submit(self, key: Hashable, item: T, group: Hashable = None) -> asyncio.Future:
        """Queue ``item`` (one per ``key`` at a time) in ``group``; the future gets its result or exception."""
        loop = asyncio.get_running_loop()
        self.forget(key)  # expected here now, and nowhere else (a session replaced after a failure may move)
        state = self._groups.setdefault(group, _Group())
        future = loop.create_future()
        state.pending.append((key, item, future))
        if state.arrived is not None:
            state.arrived.set()
        if state.flush_task is None:
            state.flush_task = loop.create_task(self._flush(state))
        return future

    def forget(self, key: Hashable) -> None:
        """``key`` will submit nothing more (its choice ended): do not wait for it."""
        for state in self._groups.values():
            state.expected.discard(key)

    async def _flush(self, state: _Group) -> None:
        try:
            await self._gather(state)
            batch, state.pending = state.pending, []
        finally:
            state.flush_task = None
        if not batch:
            return
        self.batches += 1
        self.items += len(batch)
        loop = asyncio.get_running_loop()

        def deliver(pairs: Iterable[tuple[int, Any]]) -> None:  # on the batch's thread
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting any more
                loop.call_soon_threadsafe(self._settle, state, batch, list(pairs))

        items = [item for _, item, _ in batch]
        try:
            results = await loop.run_in_executor(self._executor, self._run_batch, items, deliver)
            if len(results) != len(batch):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(batch)} items")
        except BaseException as e:  # noqa: BLE001 - handed to every caller of the batch not yet answered
            results = [e] * len(batch)
        self._settle(state, batch, enumerate(results))

    @staticmethod
    def _settle(state: _Group, batch: list[tuple[Hashable, Any, asyncio.Future]], pairs: Iterable[tuple[int, Any]]):
        """Answer the callers of ``batch`` named in ``pairs`` (those not answered yet) and expect them back."""
        for index, result in pairs:
            key, _, future = batch[index]
            if future.done():
                continue
            state.expected.add(key)
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    @staticmethod
    async def _gather(state: _Group) -> None:
        """Wait (bounded) for the expected keys, then yield while items keep arriving in the same iterations."""
        deadline = time.monotonic() + GATHER_SECONDS
        state.arrived = arrived = asyncio.Event()
        try:
            while state.expected - {key for key, _, _ in state.pending}:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                arrived.clear()
                try:
                    await asyncio.wait_for(arrived.wait(), remaining)
                except TimeoutError:
                    break
        finally:
            state.arrived = None
        seen = -1
        while len(state.pending) != seen:
            seen = len(state.pending)
            for _ in range(GATHER_PASSES):
                await asyncio.sleep(0)
