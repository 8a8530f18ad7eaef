"""Routing by precision: a client asking for full precision never routes through a quantized server, a
client accepting int8 skips only nf4 ones, and records from a newer server's quantization stay readable."""

from __future__ import annotations

import pytest

from swarm_client import NoRouteError, runtime
from swarm_client.dht_records import RemoteSpanInfo, ServerInfo, ServerState
from swarm_client.precision import accepts, check_min_precision, precision_rank
from swarm_client.routing import RouteHop
from swarm_client.sequence_manager import ClientConfig, SequenceManager


def span(peer_id: str, start: int, end: int, quant: str = "none", throughput: float = 100.0) -> RemoteSpanInfo:
    info = ServerInfo(
        state=ServerState.ONLINE,
        start_block=start,
        end_block=end,
        throughput=throughput,
        cache_tokens_left=10_000,
        quant=quant,
    )
    return RemoteSpanInfo(peer_id, start, end, info)


def manager_over(*spans: RemoteSpanInfo, **options) -> SequenceManager:
    """A manager whose swarm view is always ``spans`` (no DHT read; the DHT object is never touched)."""
    config = ClientConfig(initial_peers=[], dht_prefix="m", num_blocks=4, **options)
    manager = SequenceManager(config, dht=object())
    manager.spans = {s.peer_id: s for s in spans}
    manager.rtt = dict.fromkeys(manager.spans, 0.001)

    async def update(force: bool = False, max_age: float | None = None) -> dict[str, RemoteSpanInfo]:
        return manager.spans

    manager.update = update
    return manager


def test_ranks_and_acceptance():
    assert precision_rank("none") > precision_rank("int8") > precision_rank("nf4") > precision_rank("fp3-newer")
    assert accepts("full", "none") and not accepts("full", "int8") and not accepts("full", "nf4")
    assert accepts("int8", "int8") and not accepts("int8", "nf4")
    assert accepts("nf4", "nf4") and not accepts("nf4", "fp3-newer")
    assert accepts("any", "fp3-newer")
    with pytest.raises(ValueError, match="full, int8, nf4, any"):
        check_min_precision("fp16")
    with pytest.raises(ValueError, match="min_precision"):
        ClientConfig(initial_peers=[], dht_prefix="m", num_blocks=4, min_precision="exact")


def test_a_quantized_server_is_faster_but_a_full_precision_client_never_uses_it():
    # the quantized server claims 10x the throughput and holds every block: the default client takes it
    fast_int8 = span("Q8", 0, 4, "int8", throughput=1000.0)
    slow_full = (span("F1", 0, 2), span("F2", 2, 4))
    assert runtime.run(manager_over(fast_int8, *slow_full).make_route(0, 4)) == [RouteHop("Q8", 0, 4)]
    full = manager_over(fast_int8, *slow_full, min_precision="full")
    for _ in range(5):
        route = runtime.run(full.make_route(0, 4))
        assert {hop.peer_id for hop in route} == {"F1", "F2"}
    # replacements and spot checkers go through the same options
    assert "Q8" in full.route_options()["banned"]


def test_only_quantized_holders_gives_a_no_route_error_that_says_why():
    manager = manager_over(span("F1", 0, 2), span("N4", 2, 4, "nf4"), span("Q8", 2, 3, "int8"), min_precision="full")
    with pytest.raises(NoRouteError, match=r"(?s)block.*2.*nf4 weights.*min_precision='full'"):
        runtime.run(manager.make_route(0, 4))
    # int8 accepted, nf4 not: block 3 is still out of reach
    manager = manager_over(span("F1", 0, 2), span("N4", 2, 4, "nf4"), span("Q8", 2, 3, "int8"), min_precision="int8")
    with pytest.raises(NoRouteError, match="block 3"):
        runtime.run(manager.make_route(0, 4))
    manager = manager_over(span("F1", 0, 2), span("N4", 2, 4, "nf4"), min_precision="nf4")
    assert runtime.run(manager.make_route(0, 4)) == [RouteHop("F1", 0, 2), RouteHop("N4", 2, 4)]


def test_records_carry_the_quantization_and_tolerate_unknown_ones():
    wire = span("Q8", 0, 4, "int8").server_info.to_wire()
    assert wire["quant"] == "int8"
    assert ServerInfo.from_wire(wire).quant == "int8"
    older = {k: v for k, v in wire.items() if k != "quant"}  # a server from before quantization: full precision
    assert ServerInfo.from_wire(older).quant == "none"
    newer = {**wire, "quant": "fp3"}  # a newer server's quantization reads as itself, below every known one
    assert ServerInfo.from_wire(newer).quant == "fp3"
    assert ServerInfo.from_wire({**wire, "quant": "x" * 100}) is None  # bounded like every record field


def test_spot_checkers_compute_with_the_same_weights():
    """An int8 server checked by a full-precision one would differ by its quantization error, not by a fault:
    checkers are drawn among servers announcing the same quantization only."""
    import asyncio

    import torch

    from swarm_client.failover import start_spot_check
    from swarm_client.history import HistoryBuffer

    async def checkers(manager: SequenceManager, hop: RouteHop) -> list[str] | None:
        check = start_spot_check(manager, hop, HistoryBuffer(), torch.zeros(1, 1, 8), 0)
        if check is None:
            return None
        check.cancel()
        return [c.peer_id for c in check.checkers]

    spans = (span("Q8a", 0, 4, "int8"), span("Q8b", 0, 4, "int8"), span("F", 0, 4), span("N4", 0, 4, "nf4"))
    manager = manager_over(*spans, spot_check_rate=1.0)
    assert asyncio.run(checkers(manager, RouteHop("Q8a", 0, 4))) == ["Q8b"]
    assert asyncio.run(checkers(manager, RouteHop("F", 0, 4))) is None  # nobody else at full precision
    assert asyncio.run(checkers(manager, RouteHop("N4", 1, 3))) is None


def test_min_precision_flag_reaches_the_client_options():
    import argparse

    from swarmserve.cli.gateway import add_client_flags, client_options

    parser = argparse.ArgumentParser()
    add_client_flags(parser)
    assert "min_precision" not in client_options(parser.parse_args([]))  # default: any server
    options = client_options(parser.parse_args(["--min-precision", "full"]))
    assert options["min_precision"] == "full"
    ClientConfig(initial_peers=[], dht_prefix="m", num_blocks=4, **options)  # a valid ClientConfig option
    with pytest.raises(SystemExit):
        parser.parse_args(["--min-precision", "fp16"])
