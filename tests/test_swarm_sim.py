"""The swarm simulator (load_tests/swarm_sim) on a tiny swarm: coverage, crash recovery, the bound, determinism."""

from __future__ import annotations

import pytest

from load_tests.swarm_sim.run import simulate


@pytest.fixture(scope="module")
def tiny():
    return simulate(12, 20, 2.0, seed=3)


def test_tiny_swarm_is_covered_and_recovers_from_a_crash(tiny):
    assert tiny.crashed > 0
    assert tiny.figures["max_missing_blocks"] > 0  # the crash did open a hole
    assert tiny.recovered_after is not None  # ... and rebalancing closed it within the run
    assert tiny.holes[-1][1] == 0


def test_without_rebalancing_the_hole_stays():
    stuck = simulate(12, 20, 2.0, seed=3, rebalance=False)
    assert stuck.crashed > 0
    assert stuck.recovered_after is None and stuck.holes[-1][1] > 0  # a broken rebalance shows as a hole


def test_served_throughput_never_exceeds_the_hardware_bound(tiny):
    assert tiny.samples
    assert all(served <= bound + 1e-6 for _, served, bound in tiny.samples)
    assert max(served for _, served, _ in tiny.samples) > 0
    assert tiny.figures["route_latency_ratio_p50"] >= 1.0 - 1e-9


def test_a_seed_gives_the_same_run(tiny):
    again = simulate(12, 20, 2.0, seed=3)
    assert again.samples == tiny.samples
    assert again.holes == tiny.holes
