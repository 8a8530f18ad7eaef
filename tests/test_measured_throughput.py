"""Routing believes what the client measured, not what a server claims: ``step_times``, the manager's
effective throughputs, and a real Sybil worker announcing 1e9 tok/s while holding every step 0.25 s."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm_client import AutoDistributedModelForCausalLM, runtime
from swarm_client.dht_records import RemoteSpanInfo, ServerInfo, ServerState
from swarm_client.failover import PendingSpotCheck
from swarm_client.routing import RouteHop, find_route
from swarm_client.sequence_manager import ClientConfig, SequenceManager
from swarm_client.step_times import StepTimes
from tests.swarm_fixtures import Swarm, greedy_route

PROMPT = torch.tensor([[3, 14, 15, 92, 65]])
NEW_TOKENS = 8


def span(peer_id: str, throughput: float) -> RemoteSpanInfo:
    info = ServerInfo(
        state=ServerState.ONLINE, start_block=0, end_block=4, throughput=throughput, cache_tokens_left=10_000
    )
    return RemoteSpanInfo(peer_id, 0, 4, info)


# --- StepTimes ------------------------------------------------------------------------------------------


def test_step_times_ewma_per_block():
    times = StepTimes(alpha=0.5)
    assert times.seconds_per_block("A", now=0) is None
    times.record("A", blocks=4, seconds=0.4, now=0)  # 0.1 s per block
    times.record("A", blocks=4, seconds=0.8, now=1)  # 0.2 s per block
    assert times.seconds_per_block("A", now=1) == pytest.approx(0.15)
    assert times.steps("A", now=1) == 2
    assert times.throughputs(now=1) == {"A": pytest.approx(1 / 0.15)}


def test_step_times_forget_stale_estimates_and_ignore_nonsense():
    times = StepTimes(ttl=10)
    times.record("A", blocks=2, seconds=1.0, now=0)
    times.record("B", blocks=0, seconds=1.0, now=0)
    times.record("C", blocks=1, seconds=float("nan"), now=0)
    assert set(times.throughputs(now=5)) == {"A"}
    assert times.throughputs(now=11) == {}
    times.record("A", blocks=2, seconds=0.2, now=12)  # a fresh start, not averaged with the forgotten one
    assert times.seconds_per_block("A", now=12) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        StepTimes(alpha=0)


# --- SequenceManager ------------------------------------------------------------------------------------


def manager(**options) -> SequenceManager:
    config = ClientConfig(initial_peers=[], dht_prefix="m", num_blocks=4, **options)
    return SequenceManager(config, dht=object())  # a DHT object is never touched by these tests


def test_manager_routes_by_measured_decode_steps():
    m = manager()
    m.spans = {"honest": span("honest", 100.0), "sybil": span("sybil", 1e9)}
    m.rtt = {"honest": 0.0, "sybil": 0.0}
    route = find_route(m.spans, 0, 4, **m.route_options())
    assert route == [RouteHop("sybil", 0, 4)]  # unmeasured: its claim counts, capped at 4 × 100
    assert m.effective_throughputs()["sybil"] == pytest.approx(400.0)
    m.record_step("sybil", blocks=4, tokens=5, seconds=1.0)  # a prefill: not timed
    assert m.step_times.steps("sybil") == 0
    for _ in range(3):
        m.record_step("sybil", blocks=4, tokens=1, seconds=0.25)
    assert m.effective_throughputs()["sybil"] == pytest.approx(16.0)
    assert find_route(m.spans, 0, 4, **m.route_options()) == [RouteHop("honest", 0, 4)]


def test_manager_takes_the_rtt_off_a_step_time():
    m = manager()
    m.rtt = {"far": 0.05}
    m.record_step("far", blocks=1, tokens=1, seconds=0.06)
    assert m.step_times.seconds_per_block("far") == pytest.approx(0.015)  # a quarter of the step at least
    m.record_step("near", blocks=2, tokens=1, seconds=0.02)
    assert m.step_times.seconds_per_block("near") == pytest.approx(0.01)


def test_trusted_peers_accept_a_comma_separated_string():
    assert manager(trusted_peers="A, B,A").trusted_peers == ["A", "B"]
    assert manager(trusted_peers=["A,B", "C"]).route_options()["trusted"] == ["A", "B", "C"]


# --- spot checks ----------------------------------------------------------------------------------------


def test_a_stalling_spot_checker_is_dropped_not_waited_for():
    async def run() -> tuple[object, object]:
        check = PendingSpotCheck.__new__(PendingSpotCheck)
        check.hop, check.checkers = RouteHop("A", 0, 4), [RouteHop("B", 0, 4)]
        check._task = asyncio.create_task(asyncio.sleep(3600))  # a checker that never answers
        stalled = await check.result(torch.ones(1, 1, 4), timeout=0.05)
        check._task = asyncio.create_task(asyncio.sleep(0, torch.ones(1, 1, 4) * 2))
        answered = await check.result(torch.ones(1, 1, 4), timeout=1.0)
        return stalled, answered

    stalled, answered = asyncio.run(run())
    assert stalled is None
    assert answered.difference == pytest.approx(0.5) and answered.checkers == [RouteHop("B", 0, 4)]


# --- a real Sybil ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sybil_announcing_1e9_loses_new_routes_once_measured(tiny_llama, local_llama):
    reference = local_llama.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT.shape[1] :]
    s = Swarm(tiny_llama)
    model = None
    try:
        honest = [s.add_worker("--throughput", "1000", blocks="0:4").peer_id for _ in range(2)]
        sybil = s.add_worker("--fault", "slow", "--throughput", "1e9", blocks="0:4").peer_id
        model = AutoDistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=[s.initial_peers], spot_check_rate=0.0
        )
        manager = model.manager
        runtime.run(manager.update(force=True))
        assert {sybil, *honest} <= set(manager.spans)
        for peer in (sybil, *honest):
            manager.rtt[peer] = 0.0  # equal RTTs: claims and measurements alone decide
        routes = []
        for _ in range(4):
            tokens, route = greedy_route(model, PROMPT, NEW_TOKENS)
            assert tokens == reference.tolist()
            routes.append([h.peer_id for h in route])
        # before any measurement the claim counts, capped (4 × 1000, not 1e9): the Sybil gets the first
        # session; its decode steps measure it at ~16 tok/s per block, and no later route goes there
        assert routes[0] == [sybil]
        assert all(route[0] in honest for route in routes[1:]), routes
        sybil_steps = runtime.run(manager.info(sybil))["inference_steps"]
        assert sybil_steps == NEW_TOKENS  # the one session's prefill and decode steps, nothing since
        assert manager.effective_throughputs()[sybil] < 100
    finally:
        if model is not None:
            model.shutdown()
        s.close()
