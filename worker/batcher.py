"""Groups inference steps that arrive while the compute thread is busy into one batch.

No timer: a lone session's step runs at once. Steps that arrive while a batch is computing wait for it
to finish and then run together (continuous batching), so latency never grows for a single user and
throughput grows with concurrency.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor

import torch

from worker.compute import SpanRunner, StepItem


class StepBatcher:
    def __init__(
        self,
        runner: SpanRunner,
        executor: Executor,
        max_batch: int = 64,
        single_stream: Callable[[], bool] | None = None,
    ):
        self.runner = runner
        #: when only one stream is open nobody can join a batch: compute on the event loop and skip the
        #: thread hop (measured: the hop + wake-ups cost more than a tiny model's whole step)
        self.single_stream = single_stream
        self.executor = executor
        self.max_batch = max_batch
        self._pending: list[tuple[StepItem, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.batches = 0
        self.batched_items = 0
        self.max_batch_seen = 0
        #: wall time of recent batches in the compute thread (profiling; exposed by the info RPC)
        self.compute_seconds: deque[float] = deque(maxlen=512)

    async def submit(self, item: StepItem) -> torch.Tensor:
        small = item.hidden.shape[0] * item.hidden.shape[1] <= 8  # never block the loop on a long prefill
        if (
            small
            and self.single_stream is not None
            and self.single_stream()
            and not self._pending
            and self._idle()
        ):
            self.batches += 1
            self.batched_items += 1
            self.max_batch_seen = max(self.max_batch_seen, 1)
            return self._timed_batch([item])[0]
        future = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    def _idle(self) -> bool:
        return self._worker is None or self._worker.done()

    def _timed_batch(self, items: list[StepItem]) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        try:
            return self.runner.inference_batch(items)
        finally:
            self.compute_seconds.append(time.perf_counter() - t0)

    def stats(self) -> dict:
        recent = list(self.compute_seconds)
        return {
            "batches": self.batches,
            "batched_steps": self.batched_items,
            "max_batch_seen": self.max_batch_seen,
            "compute_ms_median": 1000 * statistics.median(recent) if recent else None,
        }

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            batch = [(item, fut) for item, fut in batch if not fut.cancelled()]
            if not batch:
                continue
            self.batches += 1
            self.batched_items += len(batch)
            self.max_batch_seen = max(self.max_batch_seen, len(batch))
            try:
                outs = await loop.run_in_executor(self.executor, self._timed_batch, [i for i, _ in batch])
            except Exception as e:  # one failure fails the whole batch; each caller reports it
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, fut), out in zip(batch, outs, strict=True):
                if not fut.done():
                    fut.set_result(out)
