"""One decode step for all the choices decoding at once: one thread hand-off per cycle instead of two per choice.

Each choice's decode loop (``Engine._run_choice``) used to run its next step in a worker thread of its own:
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
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

#: event-loop iterations to yield after the last arrival; the longest a batch waits for expected choices
GATHER_PASSES = 3
GATHER_SECONDS = 0.005


class StepGatherer(Generic[T, R]):
    """Gathers items submitted on one event loop into batches for ``run_batch`` (run in ``executor``), which
    returns one result or exception per item. Batches may overlap: a latecomer does not wait for the batch
    in flight."""

    def __init__(self, executor: Executor, run_batch: Callable[[Sequence[T]], Sequence[Any]]):
        self._executor = executor
        self._run_batch = run_batch
        self._pending: list[tuple[Hashable, T, asyncio.Future]] = []
        #: keys whose result was delivered and whose next item has not come yet
        self._expected: set[Hashable] = set()
        self._flush_task: asyncio.Task | None = None
        #: set when an item arrives while a batch is gathering (made per batch: engines outlive event loops in tests)
        self._arrived: asyncio.Event | None = None
        self.batches = 0
        self.items = 0

    def submit(self, key: Hashable, item: T) -> asyncio.Future:
        """Queue ``item`` (one per ``key`` at a time); the future gets its result or exception."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((key, item, future))
        self._expected.discard(key)
        if self._arrived is not None:
            self._arrived.set()
        if self._flush_task is None:
            self._flush_task = loop.create_task(self._flush())
        return future

    def forget(self, key: Hashable) -> None:
        """``key`` will submit nothing more (its choice ended): do not wait for it."""
        self._expected.discard(key)

    async def _flush(self) -> None:
        try:
            await self._gather()
            batch, self._pending = self._pending, []
        finally:
            self._flush_task = None
        if not batch:
            return
        self.batches += 1
        self.items += len(batch)
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._executor, self._run_batch, [item for _, item, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(batch)} items")
        except BaseException as e:  # noqa: BLE001 - handed to every caller of the batch
            results = [e] * len(batch)
        for (key, _, future), result in zip(batch, results, strict=True):
            if future.done():
                continue
            self._expected.add(key)
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _gather(self) -> None:
        """Wait (bounded) for the expected keys, then yield while items keep arriving in the same iterations."""
        deadline = time.monotonic() + GATHER_SECONDS
        self._arrived = arrived = asyncio.Event()
        try:
            while self._expected - {key for key, _, _ in self._pending}:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                arrived.clear()
                try:
                    await asyncio.wait_for(arrived.wait(), remaining)
                except TimeoutError:
                    break
        finally:
            self._arrived = None
        seen = -1
        while len(self._pending) != seen:
            seen = len(self._pending)
            for _ in range(GATHER_PASSES):
                await asyncio.sleep(0)
