"""Groups inference steps that arrive while the compute thread is busy into one batch.

No timer: a lone session's step runs at once. Steps that arrive while a batch is computing wait for it
to finish and then run together (continuous batching), so latency never grows for a single user and
throughput grows with concurrency.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

import torch

from worker.compute import SpanRunner, StepItem


class StepBatcher:
    def __init__(self, runner: SpanRunner, executor: Executor, max_batch: int = 64):
        self.runner = runner
        self.executor = executor
        self.max_batch = max_batch
        self._pending: list[tuple[StepItem, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.batches = 0
        self.batched_items = 0
        self.max_batch_seen = 0

    async def submit(self, item: StepItem) -> torch.Tensor:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

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
                outs = await loop.run_in_executor(self.executor, self.runner.inference_batch, [i for i, _ in batch])
            except Exception as e:  # one failure fails the whole batch; each caller reports it
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, fut), out in zip(batch, outs, strict=True):
                if not fut.done():
                    fut.set_result(out)
