"""Trust policy: only named peers serve the first and the last block (they see the activations closest to the
text) — over real workers, through the gateway's backend, and in the command line's settings."""

from __future__ import annotations

import argparse
import asyncio

import pytest
import torch

from swarm_client import NoRouteError, runtime
from swarm_client.dht_records import RemoteSpanInfo, ServerInfo, ServerState
from swarm_client.failover import start_spot_check
from swarm_client.history import HistoryBuffer
from swarm_client.routing import BanList, RouteHop
from swarm_client.sequence_manager import ClientConfig, SequenceManager
from tests.swarm_fixtures import Swarm, greedy_route

PROMPT = torch.tensor([[3, 14, 15, 92, 65]])
NEW_TOKENS = 6


def test_trusted_peers_flag_and_env_reach_the_client_options(monkeypatch):
    from gateway.settings import GatewaySettings
    from swarmserve.cli.gateway import add_client_flags, client_options, trust_settings

    parser = argparse.ArgumentParser()
    add_client_flags(parser)
    monkeypatch.setenv("SWARMSERVE_TRUSTED_PEERS", "QmEnvA, QmEnvB")
    args = parser.parse_args([])
    assert client_options(args, GatewaySettings(**trust_settings(args)))["trusted_peers"] == ["QmEnvA", "QmEnvB"]
    args = parser.parse_args(["--trusted-peers", "QmFlag"])  # the flag wins over the environment
    assert client_options(args, GatewaySettings(**trust_settings(args)))["trusted_peers"] == ["QmFlag"]
    monkeypatch.delenv("SWARMSERVE_TRUSTED_PEERS")
    args = parser.parse_args([])
    assert "trusted_peers" not in client_options(args, GatewaySettings(**trust_settings(args)))


def span(peer_id: str, start: int, end: int, throughput: float = 100.0) -> RemoteSpanInfo:
    info = ServerInfo(
        state=ServerState.ONLINE, start_block=start, end_block=end, throughput=throughput, cache_tokens_left=10_000
    )
    return RemoteSpanInfo(peer_id, start, end, info)


def manager_over(*spans: RemoteSpanInfo, **options) -> SequenceManager:
    """A manager whose swarm view is always ``spans`` (no DHT read; the DHT object is never touched)."""
    config = ClientConfig(initial_peers=[], dht_prefix="m", num_blocks=4, trusted_peers=["T1", "T2"], **options)
    manager = SequenceManager(config, dht=object())
    manager.spans = {s.peer_id: s for s in spans}
    manager.rtt = dict.fromkeys(manager.spans, 0.001)

    async def update(force: bool = False, max_age: float | None = None) -> dict[str, RemoteSpanInfo]:
        return manager.spans  # the DHT never changes here

    manager.update = update
    return manager


def test_a_replacement_of_the_first_span_is_trusted_too():
    """``failover.replace_span`` routes the failed hop's span through ``make_route``: same policy."""
    manager = manager_over(span("T1", 0, 4, 10), span("T2", 0, 2, 10), span("U", 0, 4, 1000))
    assert runtime.run(manager.make_route(0, 2))[0].peer_id in {"T1", "T2"}
    manager.ban("T1", "test: failed")
    assert runtime.run(manager.make_route(0, 2))[0].peer_id == "T2"
    assert runtime.run(manager.make_route(1, 3)) == [RouteHop("U", 1, 3)]  # the middle: anyone
    manager.ban("T2", "test: failed")
    with pytest.raises(NoRouteError, match="block 0.*--trusted-peers"):
        runtime.run(manager.make_route(0, 2))


def test_spot_checkers_of_an_end_block_are_trusted():
    async def checkers(manager: SequenceManager, hop: RouteHop) -> list[str] | None:
        check = start_spot_check(manager, hop, HistoryBuffer(), torch.zeros(1, 1, 8), 0)
        if check is None:
            return None
        check.cancel()
        return [c.peer_id for c in check.checkers]

    hop = RouteHop("T1", 0, 4)
    manager = manager_over(span("T1", 0, 4), span("U", 0, 4, 1000), span("T2", 0, 4), spot_check_rate=1.0)
    route = asyncio.run(checkers(manager, hop))
    assert route[0] == route[-1] == "T2" and set(route) <= {"T2", "U"}  # ends trusted, the middle: anyone
    manager = manager_over(span("T1", 0, 4), span("U", 0, 4, 1000), spot_check_rate=1.0)
    assert asyncio.run(checkers(manager, hop)) is None  # only an untrusted server could check: no check
    assert asyncio.run(checkers(manager, RouteHop("T1", 1, 3))) == ["U"]  # the middle blocks: anyone
    manager.ban("U", "test: went silent")  # its RTT is dropped; once the ban runs out it is still unmeasured
    manager.bans = BanList(base=manager.config.ban_base, max_ban=manager.config.ban_max)
    assert asyncio.run(checkers(manager, RouteHop("T1", 1, 3))) is None  # never a checker before a ping answers


@pytest.mark.slow
def test_every_route_starts_and_ends_on_the_trusted_peer(tiny_llama, local_llama):
    from gateway.backends.swarm import SwarmBackend

    reference = local_llama.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT.shape[1] :]
    s = Swarm(tiny_llama)
    backends = []
    try:
        # the trusted server holds everything but claims to be slow; the untrusted ones split the model, fast
        trusted = s.add_worker("--throughput", "10", blocks="0:4").peer_id
        first = s.add_worker("--throughput", "1000", blocks="0:2").peer_id
        second = s.add_worker("--throughput", "1000", blocks="2:4").peer_id
        open_backend = SwarmBackend(tiny_llama, [s.initial_peers], spot_check_rate=0.0)
        backends.append(open_backend)
        backend = SwarmBackend(tiny_llama, [s.initial_peers], trusted_peers=[trusted], spot_check_rate=0.0)
        backends.append(backend)
        for b in backends:
            runtime.run(b.manager.update(force=True))
            b.manager.rtt.update(dict.fromkeys((trusted, first, second), 0.001))  # equal RTTs: deterministic
        # without a policy the fast untrusted servers take the whole route
        _, route = greedy_route(open_backend.model, PROMPT, NEW_TOKENS)
        assert [h.peer_id for h in route] == [first, second]

        routes = []
        for _ in range(5):
            tokens, route = greedy_route(backend.model, PROMPT, NEW_TOKENS)
            assert tokens == reference.tolist()
            routes.append(route)
        for route in routes:
            assert route[0].peer_id == trusted and route[0].start == 0, route
            assert route[-1].peer_id == trusted and route[-1].end == 4, route
        # the middle blocks are nobody's secret: the fast servers still run them
        assert {h.peer_id for route in routes for h in route[1:-1]} <= {first, second}
        assert len(routes[0]) > 2

        state = backend.swarm_state()
        assert state["trust_policy"]["trusted_peers"] == [trusted]
        assert "blocks 0 and 3" in state["trust_policy"]["applies_to"]
        assert {row["peer_id"]: row["trusted"] for row in state["spans"]} == {
            trusted: True,
            first: False,
            second: False,
        }
        assert open_backend.swarm_state()["trust_policy"]["trusted_peers"] == []

        # with the trusted peer out of the picture, nothing else may take the ends: a clear NoRouteError
        backend.manager.ban(trusted, "test: the trusted server failed")
        with pytest.raises(NoRouteError, match="trusted_peers") as info:
            runtime.run(backend.manager.make_route(0, 4))
        assert info.value.missing_blocks == [0, 3]
    finally:
        for b in backends:
            b.close()
        s.close()


def test_gateway_config_takes_the_settings_trust_policy() -> None:
    """A ``GatewayConfig`` built in code (not by the CLI) still honours ``SWARMSERVE_TRUSTED_PEERS``."""
    from gateway.run import trust_policy

    assert trust_policy(["A", "B"], {"push": True}) == {"push": True, "trusted_peers": ["A", "B"]}
    assert trust_policy(["A"], {"trusted_peers": ["C"]}) == {"trusted_peers": ["C"]}  # explicit options win
    assert trust_policy([], {"push": True}) == {"push": True}
