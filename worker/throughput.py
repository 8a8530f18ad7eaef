"""Measure how many tokens/s this server pushes through one of its blocks (announced for routing)."""

from __future__ import annotations

import time

import torch

from swarm_client.families import CacheLayout
from worker.cache import CacheManager
from worker.compute import SpanRunner


def measure_throughput(
    runner: SpanRunner,
    hidden_size: int,
    layout: CacheLayout,
    dtype: torch.dtype,
    device: torch.device,
    steps: int = 8,
) -> float:
    """Decode-step tokens/s per block: time single-token steps through the span with a scratch cache."""
    caches = CacheManager(steps + 2, len(runner.blocks), layout, dtype, device)
    cache = caches.open("throughput-probe", 1, steps + 1)
    caches.ensure_capacity(cache, steps + 1)
    x = torch.randn(1, 1, hidden_size, dtype=dtype, device=device)
    runner.inference_step(cache, x, 0)  # warm-up
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        runner.inference_step(cache, x, i)
    elapsed = max(time.perf_counter() - t0, 1e-6)
    caches.free("throughput-probe")
    return steps * len(runner.blocks) / elapsed
