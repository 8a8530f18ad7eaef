"""Groups inference steps from different sessions into batches (continuous batching).

A lone session's step runs at once. Steps that arrive while a batch is computing wait for it to finish
and then run together. Before a batch starts, it may also wait a little for sessions whose next step is
predicted to arrive within a wait that the batching saves (worker/batch_policy.py), so streams that
come back a few milliseconds apart do not split into many small batches. A single user never waits:
with one open stream nobody is expected.

Pipeline groups: a client may tag its sessions' steps with a ``batch_group`` (``ClientConfig.pipeline_groups``).
A batch then takes the steps of one group only (the group of the oldest pending step) and waits only for
that group's sessions, so in a chain of servers one server computes group A while the next computes group B,
instead of both computing the one big batch in turn and each idling half the time. Untagged steps form one
group of their own.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor

import torch

from worker.batch_policy import ArrivalPredictor, BatchCosts, plan_wait
from worker.compute import SpanRunner, StepItem

#: the longest step that counts as a decode step: a token and up to 16 guesses (gateway/speculation/verify.py)
DECODE_STEP_MAX_TOKENS = 17


class StepBatcher:
    def __init__(
        self,
        runner: SpanRunner,
        executor: Executor,
        max_batch: int = 64,
        single_stream: Callable[[], bool] | None = None,
        max_wait: float = 0.25,
    ):
        self.runner = runner
        #: when only one stream is open nobody can join a batch: compute on the event loop and skip the
        #: thread hop (measured: the hop + wake-ups cost more than a tiny model's whole step)
        self.single_stream = single_stream
        self.executor = executor
        self.max_batch = max_batch
        #: upper bound on how long a batch may wait for predicted arrivals (0: never wait)
        self.max_wait = max_wait
        self.costs = BatchCosts()
        self.arrivals = ArrivalPredictor()
        self._arrived = asyncio.Event()
        self.waits = 0
        self.waited_seconds = 0.0
        self._pending: list[tuple[StepItem, asyncio.Future]] = []
        #: pipeline group of every session seen (None: untagged), so waits are for the batch's own group
        self._groups: dict[str, int | None] = {}
        self._worker: asyncio.Task | None = None
        self.batches = 0
        self.batched_items = 0
        self.max_batch_seen = 0
        #: batches that failed and were rerun step by step, so one broken step failed only its own session
        self.isolated_failures = 0
        #: wall time of recent batches in the compute thread (profiling; exposed by the info RPC)
        self.compute_seconds: deque[float] = deque(maxlen=512)

    async def submit(self, item: StepItem) -> torch.Tensor:
        self._groups[item.cache.session_id] = item.cache.batch_group
        # decode steps set the session's pace: one token, or a few (a speculative step's guesses)
        if self.runner.can_batch(item) and item.hidden.shape[1] <= DECODE_STEP_MAX_TOKENS:
            self.arrivals.arrived(item.cache.session_id, item.hidden.shape[0])
        small = _tokens(item) <= 8  # never block the loop on a long prefill
        if small and self.single_stream is not None and self.single_stream() and not self._pending and self._idle():
            self.batches += 1
            self.batched_items += 1
            self.max_batch_seen = max(self.max_batch_seen, 1)
            return self._timed_batch([item])[0]
        future = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        self._arrived.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    def forget(self, session_id: str) -> None:
        """The session's stream ended: stop expecting its steps."""
        self.arrivals.forget(session_id)
        self._groups.pop(session_id, None)

    def _idle(self) -> bool:
        return self._worker is None or self._worker.done()

    def _timed_batch(self, items: list[StepItem]) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        result = self.runner.inference_batch(items)
        seconds = time.perf_counter() - t0
        self.compute_seconds.append(seconds)
        if all(self.runner.can_batch(i) for i in items):
            self.costs.observe(sum(_tokens(i) for i in items), seconds)
        return result

    def stats(self) -> dict:
        recent = list(self.compute_seconds)
        return {
            "batches": self.batches,
            "batched_steps": self.batched_items,
            "max_batch_seen": self.max_batch_seen,
            "compute_ms_median": 1000 * statistics.median(recent) if recent else None,
            "batch_waits": self.waits,
            "isolated_failures": self.isolated_failures,
            "batch_wait_seconds": round(self.waited_seconds, 3),
        }

    async def _gather(self, group: int | None) -> None:
        """Hold ``group``'s pending steps while waiting for its sessions due soon pays for itself."""
        if self.max_wait <= 0:
            return
        loop = asyncio.get_running_loop()
        start = loop.time()
        while len(self._pending) < self.max_batch:
            now = time.monotonic()
            batchable = [
                item for item, _ in self._pending if self.runner.can_batch(item) and item.cache.batch_group == group
            ]
            if not batchable:
                return
            # not expected here: sessions already pending, and those of other groups
            skip = {item.cache.session_id for item, _ in self._pending}
            skip.update(session_id for session_id, g in self._groups.items() if g != group)
            expected = self.arrivals.expected(skip, now)
            budget = self.max_wait - (loop.time() - start)
            wait = plan_wait(self.costs, expected, sum(_tokens(i) for i in batchable), now, budget)
            if wait <= 0:
                return
            self._arrived.clear()
            t0 = loop.time()
            try:
                async with asyncio.timeout(wait):
                    await self._arrived.wait()
            except TimeoutError:
                return
            finally:
                self.waits += 1
                self.waited_seconds += loop.time() - t0

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            group = self._pending[0][0].cache.batch_group  # the oldest pending step's group goes first
            await self._gather(group)
            batch, rest = [], []
            for pending in self._pending:
                mine = pending[0].cache.batch_group == group and len(batch) < self.max_batch
                (batch if mine else rest).append(pending)
            self._pending = rest
            batch = [(item, fut) for item, fut in batch if not fut.cancelled()]
            if not batch:
                continue
            self.batches += 1
            self.batched_items += len(batch)
            self.max_batch_seen = max(self.max_batch_seen, len(batch))
            try:
                outs = await loop.run_in_executor(self.executor, self._timed_batch, [i for i, _ in batch])
            except Exception:
                if len(batch) == 1:
                    raise_into(batch[0][1])
                    continue
                # one step broke the shared pass: run each alone so only the broken one fails (the rows the
                # pass wrote into caches are rewritten at the same positions, so retrying is exact)
                self.isolated_failures += 1
                for item, fut in batch:
                    try:
                        (out,) = await loop.run_in_executor(self.executor, self._timed_batch, [item])
                    except Exception:
                        raise_into(fut)
                    else:
                        if not fut.done():
                            fut.set_result(out)
                continue
            for (_, fut), out in zip(batch, outs, strict=True):
                if not fut.done():
                    fut.set_result(out)


def raise_into(future: asyncio.Future) -> None:
    """Hand the exception being handled to ``future``'s caller (unless it gave up waiting)."""
    if not future.done():
        future.set_exception(sys.exception())


def _tokens(item: StepItem) -> int:
    """Rows the step adds to a batch: one per token of each sequence (a batch's cost grows with these)."""
    return item.hidden.shape[0] * item.hidden.shape[1]
