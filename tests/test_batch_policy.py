"""The batch-start policy: measured costs, predicted arrivals, and a wait only when it pays for itself."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.test_batching import make_sessions, runner_and_layout  # noqa: F401 - fixture
from worker.batch_policy import ArrivalPredictor, BatchCosts, plan_wait
from worker.batcher import StepBatcher
from worker.compute import StepItem


def cpu_like_costs() -> BatchCosts:
    """Two rows cost twice one row (GEMV), eight rows barely more than four (GEMM): as measured here."""
    costs = BatchCosts()
    for rows, seconds in [(1, 0.010), (2, 0.020), (4, 0.017), (8, 0.022)]:
        costs.observe(rows, seconds)
    return costs


def test_costs_interpolate_and_extrapolate():
    costs = cpu_like_costs()
    assert costs.estimate(2) == pytest.approx(0.020)
    assert costs.estimate(6) == pytest.approx(0.0195)  # between 4 and 8
    assert costs.estimate(16) == pytest.approx(0.022 + 8 * 0.005 / 4)  # slope of the two largest sizes
    assert BatchCosts().estimate(3) is None
    one = BatchCosts()
    one.observe(1, 0.01)
    assert one.estimate(4) == pytest.approx(0.04)  # one size known: no saving assumed
    assert one.saving(1, 3) == pytest.approx(0.0)


def test_saving_reflects_the_hardware():
    costs = cpu_like_costs()
    assert costs.saving(1, 1) == pytest.approx(0.0)  # two rows cost two single rows: waiting gains nothing
    assert costs.saving(4, 4) == pytest.approx(0.017 + 0.017 - 0.022)


def test_predictor_learns_periods_and_drops_idle_sessions():
    p = ArrivalPredictor()
    for t in (0.0, 0.1, 0.2):
        p.arrived("a", 1, now=t)
    p.arrived("b", 2, now=0.15)
    p.arrived("b", 2, now=0.25)
    assert p.expected(set(), now=0.26) == [(pytest.approx(0.3), 1), (pytest.approx(0.35), 2)]
    assert p.expected({"a"}, now=0.26) == [(pytest.approx(0.35), 2)]
    late = p.expected(set(), now=0.32)  # "a" is late: expected shortly, not in the past
    assert late[0][0] > 0.32
    assert p.expected(set(), now=5.0) == []  # silent for many periods: idle, not expected
    p.forget("b")
    assert "b" not in p.sessions


def test_plan_waits_only_as_long_as_it_saves():
    costs = cpu_like_costs()
    once = {"recurring": 1}  # the saving of one step only
    # one row pending, one due in 1 ms: 1 + 1 rows save nothing on this hardware
    assert plan_wait(costs, [(1.001, 1)], pending_rows=1, now=1.0, max_wait=1.0) == 0.0
    # four pending, four due in 5 ms: saves 12 ms of compute, so wait
    assert plan_wait(costs, [(1.005, 4)], pending_rows=4, now=1.0, max_wait=1.0, **once) == pytest.approx(0.005)
    # ... but not 20 ms for them
    assert plan_wait(costs, [(1.020, 4)], pending_rows=4, now=1.0, max_wait=1.0, **once) == 0.0
    # several due: the latest one that still pays, and never past max_wait
    due = [(1.002, 2), (1.004, 2), (1.5, 8)]
    assert plan_wait(costs, due, pending_rows=4, now=1.0, max_wait=1.0, **once) == pytest.approx(0.004)
    assert plan_wait(costs, due, pending_rows=4, now=1.0, max_wait=0.003, **once) == pytest.approx(0.002)
    assert plan_wait(BatchCosts(), due, pending_rows=4, now=1.0, max_wait=1.0) == 0.0  # nothing measured


def test_plan_counts_the_saving_of_the_steps_that_stay_merged():
    costs = cpu_like_costs()  # 4 + 4 rows together save 12 ms a step
    assert plan_wait(costs, [(1.020, 4)], pending_rows=4, now=1.0, max_wait=1.0, recurring=1) == 0.0
    # merged sessions stay merged: over 4 steps the 20 ms wait saves 48 ms
    assert plan_wait(costs, [(1.020, 4)], pending_rows=4, now=1.0, max_wait=1.0, recurring=4) == pytest.approx(0.02)
    assert plan_wait(costs, [(1.060, 4)], pending_rows=4, now=1.0, max_wait=1.0, recurring=4) == 0.0
    # a saving of nothing stays nothing however often it recurs
    assert plan_wait(costs, [(1.001, 1)], pending_rows=1, now=1.0, max_wait=1.0, recurring=4) == 0.0


class FixedCosts(BatchCosts):
    """A cost profile the batcher cannot retune: the policy under test, not this machine's timing noise.

    (A loaded CI machine once timed a real one-row batch slow enough to make batching look worthwhile.)
    """

    def __init__(self, profile: dict[int, float]) -> None:
        super().__init__()
        for rows, seconds in profile.items():
            super().observe(rows, seconds)

    def observe(self, rows: int, seconds: float) -> None:
        pass


def _staggered_run(runner, layout, costs: BatchCosts) -> tuple[StepBatcher, list, list]:
    """Eight sessions with a 0.5 s step period submit one step each, 1 ms apart."""
    sessions = make_sessions(runner, layout, [2, 3, 4, 5, 6, 7, 8, 9], [1] * 8)
    reference = make_sessions(runner, layout, [2, 3, 4, 5, 6, 7, 8, 9], [1] * 8)
    executor = ThreadPoolExecutor(max_workers=1)
    batcher = StepBatcher(runner, executor)
    batcher.costs = costs
    now = time.monotonic()
    for cache in sessions:  # each came every 0.5 s so far; the next is due ~50 ms from now
        batcher.arrivals.arrived(cache.session_id, 1, now=now - 0.95)
        batcher.arrivals.arrived(cache.session_id, 1, now=now - 0.45)
    token = torch.randn(1, 1, 64)

    async def one(i, cache):
        await asyncio.sleep(0.001 * i)
        return await batcher.submit(StepItem(cache, token, cache.position))

    async def run_all():
        return await asyncio.gather(*(one(i, c) for i, c in enumerate(sessions)))

    outs = asyncio.run(run_all())
    expected = [runner.inference_step(c, token, c.position) for c in reference]
    executor.shutdown()
    return batcher, outs, expected


def test_batcher_waits_for_staggered_sessions_when_batching_pays(runner_and_layout):  # noqa: F811
    runner, layout, _ = runner_and_layout
    costs = FixedCosts({1: 1.0, 8: 1.1})  # a GPU-like profile: eight rows cost about one
    batcher, outs, expected = _staggered_run(runner, layout, costs)
    assert batcher.batches == 1 and batcher.max_batch_seen == 8
    assert batcher.waits >= 1
    for out, ref in zip(outs, expected, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_batcher_does_not_wait_when_batching_saves_nothing(runner_and_layout):  # noqa: F811
    runner, layout, _ = runner_and_layout
    costs = FixedCosts({rows: 0.01 * rows for rows in (1, 2, 8)})  # linear: a batch costs its rows alone
    batcher, outs, expected = _staggered_run(runner, layout, costs)
    assert batcher.waits == 0
    assert batcher.batches > 1  # the first step started alone instead of waiting for the others
    for out, ref in zip(outs, expected, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
