"""Unit tests for swarm_client.routing: route choice, missing-block errors, ban backoff."""

from __future__ import annotations

import pytest

from swarm_client.dht_records import RemoteSpanInfo, ServerInfo, ServerState
from swarm_client.errors import NoRouteError
from swarm_client.routing import (
    CACHE_PENALTY,
    CLAIM_CAP_FACTOR,
    BanList,
    RouteHop,
    coverage,
    effective_throughputs,
    find_route,
    format_blocks,
    missing_blocks,
)


def span(
    peer_id: str,
    start: int,
    end: int,
    *,
    throughput: float = 100.0,
    state: ServerState = ServerState.ONLINE,
    cache_tokens_left: int = 10_000,
) -> RemoteSpanInfo:
    info = ServerInfo(
        state=state,
        start_block=start,
        end_block=end,
        throughput=throughput,
        cache_tokens_left=cache_tokens_left,
    )
    return RemoteSpanInfo(peer_id, start, end, info)


def swarm(*spans: RemoteSpanInfo) -> dict[str, RemoteSpanInfo]:
    return {s.peer_id: s for s in spans}


# --- find_route -------------------------------------------------------------------------------------


def test_single_server_covers_everything():
    assert find_route(swarm(span("A", 0, 8)), 0, 8) == [RouteHop("A", 0, 8)]


def test_empty_range_is_empty_route():
    assert find_route(swarm(span("A", 0, 8)), 3, 3) == []


@pytest.mark.parametrize("start,end", [(-1, 3), (5, 2)])
def test_invalid_range_raises(start, end):
    with pytest.raises(ValueError):
        find_route(swarm(span("A", 0, 8)), start, end)


def test_chain_of_three():
    spans = swarm(span("A", 0, 3), span("B", 3, 6), span("C", 6, 9))
    assert find_route(spans, 0, 9) == [RouteHop("A", 0, 3), RouteHop("B", 3, 6), RouteHop("C", 6, 9)]


def test_hops_are_contiguous_and_cover_range():
    spans = swarm(span("A", 0, 4), span("B", 2, 7), span("C", 5, 10), span("D", 1, 9, throughput=30))
    route = find_route(spans, 0, 10)
    assert route[0].start == 0 and route[-1].end == 10
    assert all(a.end == b.start for a, b in zip(route[:-1], route[1:], strict=True))
    for hop in route:
        assert spans[hop.peer_id].start <= hop.start < hop.end <= spans[hop.peer_id].end


def test_overlapping_spans_prefer_fewer_hops():
    # The full-model server costs one rtt; the pair costs two at equal compute.
    spans = swarm(span("A", 0, 5), span("B", 5, 10), span("C", 0, 10))
    assert find_route(spans, 0, 10) == [RouteHop("C", 0, 10)]


def test_overlapping_spans_split_point_is_inside_overlap():
    spans = swarm(span("A", 0, 6), span("B", 4, 10))
    route = find_route(spans, 0, 10)
    assert [h.peer_id for h in route] == ["A", "B"]
    assert 4 <= route[0].end <= 6


def test_mid_span_entry_and_early_exit():
    spans = swarm(span("A", 0, 10))
    assert find_route(spans, 3, 7) == [RouteHop("A", 3, 7)]


def test_sub_range_chain_starts_mid_span():
    spans = swarm(span("A", 0, 5), span("B", 5, 10))
    assert find_route(spans, 2, 8) == [RouteHop("A", 2, 5), RouteHop("B", 5, 8)]


def test_failed_span_replaced_by_several_servers():
    spans = swarm(span("A", 0, 4), span("B", 4, 8), span("C", 4, 6), span("D", 6, 8), span("E", 8, 12))
    route = find_route(spans, 0, 12, banned={"B"})
    assert route == [RouteHop("A", 0, 4), RouteHop("C", 4, 6), RouteHop("D", 6, 8), RouteHop("E", 8, 12)]


def test_banned_peer_avoided_even_if_faster():
    spans = swarm(span("fast", 0, 4, throughput=1000), span("slow", 0, 4, throughput=10))
    assert find_route(spans, 0, 4)[0].peer_id == "fast"
    assert find_route(spans, 0, 4, banned=["fast"]) == [RouteHop("slow", 0, 4)]


@pytest.mark.parametrize("state", [ServerState.JOINING, ServerState.OFFLINE])
def test_only_online_servers_are_used(state):
    spans = swarm(span("A", 0, 4, throughput=1000, state=state), span("B", 0, 4, throughput=1))
    assert find_route(spans, 0, 4) == [RouteHop("B", 0, 4)]


def test_rtt_preference():
    spans = swarm(span("near", 0, 4), span("far", 0, 4))
    assert find_route(spans, 0, 4, rtt={"near": 0.001, "far": 0.5})[0].peer_id == "near"
    assert find_route(spans, 0, 4, rtt={"near": 0.5, "far": 0.001})[0].peer_id == "far"


def test_default_rtt_applies_to_unmeasured_peers():
    spans = swarm(span("measured", 0, 4), span("unknown", 0, 4))
    route = find_route(spans, 0, 4, rtt={"measured": 0.05}, default_rtt=0.01)
    assert route == [RouteHop("unknown", 0, 4)]
    route = find_route(spans, 0, 4, rtt={"measured": 0.05}, default_rtt=1.0)
    assert route == [RouteHop("measured", 0, 4)]


def test_throughput_preference():
    spans = swarm(span("A", 0, 6, throughput=50), span("B", 0, 6, throughput=500))
    assert find_route(spans, 0, 6) == [RouteHop("B", 0, 6)]


def test_throughput_outweighs_extra_hop_when_large():
    # One slow server (6 blocks at 1 tok/s = 6 s) vs two fast ones (2 rtts + 0.06 s).
    spans = swarm(span("slow", 0, 6, throughput=1), span("F1", 0, 3, throughput=100), span("F2", 3, 6))
    assert [h.peer_id for h in find_route(spans, 0, 6)] == ["F1", "F2"]


def test_extra_hop_outweighs_small_throughput_gain():
    spans = swarm(span("one", 0, 6, throughput=100), span("F1", 0, 3, throughput=110), span("F2", 3, 6))
    assert find_route(spans, 0, 6) == [RouteHop("one", 0, 6)]


def test_zero_throughput_server_used_only_as_last_resort():
    spans = swarm(span("zero", 0, 4, throughput=0), span("ok", 2, 4))
    assert find_route(spans, 0, 4) == [RouteHop("zero", 0, 2), RouteHop("ok", 2, 4)]


def test_cache_penalty_prefers_server_with_room():
    spans = swarm(
        span("full", 0, 4, throughput=1000, cache_tokens_left=10),
        span("roomy", 0, 4, throughput=10, cache_tokens_left=5000),
    )
    assert find_route(spans, 0, 4)[0].peer_id == "full"
    assert find_route(spans, 0, 4, cache_tokens_needed=100)[0].peer_id == "roomy"


def test_cache_penalty_is_a_last_resort_not_a_ban():
    spans = swarm(span("full", 0, 4, cache_tokens_left=10))
    assert find_route(spans, 0, 4, cache_tokens_needed=100) == [RouteHop("full", 0, 4)]
    assert CACHE_PENALTY > 100


def test_cache_penalty_routes_around_full_server_via_two_hops():
    spans = swarm(span("full", 0, 6, cache_tokens_left=0), span("L", 0, 3), span("R", 3, 6))
    assert [h.peer_id for h in find_route(spans, 0, 6, cache_tokens_needed=1)] == ["L", "R"]


def test_ties_broken_by_peer_id():
    spans = swarm(span("zeta", 0, 4), span("alpha", 0, 4), span("mid", 0, 4))
    assert find_route(spans, 0, 4) == [RouteHop("alpha", 0, 4)]


def test_ties_deterministic_regardless_of_insertion_order():
    a = [span("A", 0, 6), span("B", 3, 10), span("C", 0, 10, throughput=50), span("D", 5, 10)]
    first = find_route(swarm(*a), 0, 10)
    second = find_route(swarm(*reversed(a)), 0, 10)
    assert first == second


def test_ties_prefer_fewer_hops_over_peer_id():
    # "A"+"B" splits the same compute as "Z" but pays one more rtt; with rtt 0 the costs tie exactly.
    spans = swarm(span("A", 0, 2), span("B", 2, 4), span("Z", 0, 4))
    assert find_route(spans, 0, 4, default_rtt=0.0) == [RouteHop("Z", 0, 4)]


def test_spans_outside_requested_range_ignored():
    spans = swarm(span("A", 0, 2), span("B", 2, 6), span("C", 6, 9))
    assert find_route(spans, 2, 6) == [RouteHop("B", 2, 6)]


def test_no_route_names_missing_blocks():
    spans = swarm(span("A", 0, 3), span("B", 6, 8), span("C", 9, 10))
    with pytest.raises(NoRouteError) as err:
        find_route(spans, 0, 10)
    assert err.value.missing_blocks == [3, 4, 5, 8]
    assert "blocks 3..5, 8" in str(err.value)


def test_no_route_single_missing_block_message():
    spans = swarm(span("A", 0, 4), span("B", 5, 8))
    with pytest.raises(NoRouteError, match=r"block 4\b") as err:
        find_route(spans, 0, 8)
    assert err.value.missing_blocks == [4]


def test_no_route_only_reports_blocks_in_requested_range():
    spans = swarm(span("A", 2, 4))
    with pytest.raises(NoRouteError) as err:
        find_route(spans, 3, 6)
    assert err.value.missing_blocks == [4, 5]


def test_no_route_when_everything_banned_mentions_bans():
    spans = swarm(span("A", 0, 4), span("B", 0, 4, state=ServerState.JOINING))
    with pytest.raises(NoRouteError) as err:
        find_route(spans, 0, 4, banned={"A"})
    assert err.value.missing_blocks == [0, 1, 2, 3]
    assert "1 banned" in str(err.value) and "1 not ONLINE" in str(err.value)


def test_no_route_empty_swarm():
    with pytest.raises(NoRouteError) as err:
        find_route({}, 0, 3)
    assert err.value.missing_blocks == [0, 1, 2]
    assert "blocks 0..2" in str(err.value)


# --- coverage ---------------------------------------------------------------------------------------


def test_coverage_lists_online_peers_sorted():
    spans = swarm(span("B", 0, 2), span("A", 1, 3), span("J", 0, 3, state=ServerState.JOINING), span("O", 2, 3))
    assert coverage(spans, 4) == [["B"], ["A", "B"], ["A", "O"], []]


def test_coverage_clips_to_num_blocks():
    assert coverage(swarm(span("A", 2, 10)), 4) == [[], [], ["A"], ["A"]]


def test_missing_blocks():
    spans = swarm(span("A", 0, 2), span("B", 4, 5), span("X", 2, 4, state=ServerState.OFFLINE))
    assert missing_blocks(spans, 6) == [2, 3, 5]
    assert missing_blocks(swarm(span("A", 0, 6)), 6) == []


@pytest.mark.parametrize(
    "blocks,text",
    [([], "no blocks"), ([3], "block 3"), ([5, 3, 4], "blocks 3..5"), ([0, 2, 3, 7], "blocks 0, 2..3, 7")],
)
def test_format_blocks(blocks, text):
    assert format_blocks(blocks) == text


def test_banlist_feeds_find_route():
    spans = swarm(span("A", 0, 4, throughput=1000), span("B", 0, 4))
    bans = BanList()
    bans.ban("A", now=0.0)
    assert find_route(spans, 0, 4, banned=bans.banned(now=0.5)) == [RouteHop("B", 0, 4)]
    assert find_route(spans, 0, 4, banned=bans.banned(now=1.5)) == [RouteHop("A", 0, 4)]


# --- claimed vs measured throughput ---------------------------------------------------------------------


def test_claims_are_capped_at_a_multiple_of_the_median_claim():
    spans = swarm(span("A", 0, 4, throughput=100), span("B", 0, 4, throughput=120), span("S", 0, 4, throughput=1e9))
    speeds = effective_throughputs(spans)
    assert speeds == {"A": 100, "B": 120, "S": CLAIM_CAP_FACTOR * 120}


def test_measurement_below_the_claim_wins_and_above_it_changes_nothing():
    spans = swarm(span("A", 0, 4, throughput=100), span("S", 0, 4, throughput=400))
    speeds = effective_throughputs(spans, measured={"S": 8.0, "A": 5000.0})
    assert speeds == {"A": 100, "S": 8.0}


def test_one_huge_claim_no_longer_outweighs_load():
    """Uncapped, 1e9 tok/s makes a server's load irrelevant: every session would pile onto it."""
    spans = swarm(span("honest", 0, 4), span("sybil", 0, 4, throughput=1e9))
    load = {"sybil": 5.0}  # twenty of this client's sessions already there
    assert find_route(spans, 0, 4, load=load, throughput={"honest": 100, "sybil": 1e9}) == [RouteHop("sybil", 0, 4)]
    assert find_route(spans, 0, 4, load=load) == [RouteHop("honest", 0, 4)]
    # unloaded, the (capped) claim still draws the route: it is measured before it is believed less
    assert find_route(spans, 0, 4) == [RouteHop("sybil", 0, 4)]


def test_measured_slow_server_loses_its_routes():
    spans = swarm(span("honest", 0, 4), span("sybil", 0, 4, throughput=1e9))
    speeds = effective_throughputs(spans, measured={"sybil": 16.0})
    assert find_route(spans, 0, 4, throughput=speeds) == [RouteHop("honest", 0, 4)]


# --- trust policy ---------------------------------------------------------------------------------------


def test_trusted_peers_serve_the_first_and_the_last_block():
    spans = swarm(span("T", 0, 6, throughput=10), span("F1", 0, 3, throughput=1000), span("F2", 3, 6, throughput=1000))
    assert [h.peer_id for h in find_route(spans, 0, 6)] == ["F1", "F2"]
    route = find_route(spans, 0, 6, trusted=["T"], num_blocks=6)
    assert route[0].peer_id == "T" and route[-1].peer_id == "T"
    assert route[0].start == 0 and route[-1].end == 6


def test_trust_policy_leaves_the_middle_to_anyone():
    spans = swarm(span("T", 0, 6, throughput=1), span("F", 0, 6, throughput=1000))
    route = find_route(spans, 0, 6, trusted=["T"], num_blocks=6, default_rtt=0.0)
    assert route == [RouteHop("T", 0, 1), RouteHop("F", 1, 5), RouteHop("T", 5, 6)]
    # a sub-range that touches neither end is unrestricted
    assert find_route(spans, 1, 5, trusted=["T"], num_blocks=6) == [RouteHop("F", 1, 5)]
    # one that starts mid-model and runs to the end must end on a trusted peer
    assert find_route(spans, 3, 6, trusted=["T"], num_blocks=6, default_rtt=0.0)[-1].peer_id == "T"


def test_no_trusted_server_for_an_end_block_says_what_to_do():
    spans = swarm(span("T", 0, 3), span("U", 3, 6))
    with pytest.raises(NoRouteError, match="block 5.*trusted_peers") as info:
        find_route(spans, 0, 6, trusted=["T"], num_blocks=6)
    assert info.value.missing_blocks == [5]
    with pytest.raises(NoRouteError, match="blocks 0, 5") as info:
        find_route(spans, 0, 6, trusted=["T"], num_blocks=6, banned={"T"})
    assert info.value.missing_blocks == [0, 5]


def test_trust_policy_needs_num_blocks():
    with pytest.raises(ValueError, match="num_blocks"):
        find_route(swarm(span("T", 0, 2)), 0, 2, trusted=["T"])


# --- NoRouteError explanations (route_explain) ----------------------------------------------------------


def test_no_route_names_the_unserved_range_and_the_ban_reason():
    spans = swarm(span("A", 0, 2), span("N", 2, 4))
    reason = "did not answer a ping within 3.0 s (announces /ip4/10.232.0.2/tcp/31330) — it may be behind NAT"
    with pytest.raises(NoRouteError) as err:
        find_route(spans, 0, 4, banned={"N"}, why={"N": reason})
    text = str(err.value)
    assert err.value.missing_blocks == [2, 3]
    assert "blocks 2..3 have no usable server: peer N is banned: did not answer a ping within 3.0 s" in text
    assert "/ip4/10.232.0.2/tcp/31330" in text and "peer A" not in text


def test_no_route_tells_apart_absent_banned_and_not_online_ranges():
    spans = swarm(span("A", 0, 2), span("J", 4, 6, state=ServerState.JOINING), span("B", 6, 8))
    with pytest.raises(NoRouteError) as err:
        find_route(spans, 0, 8, banned={"B"})
    text = str(err.value)
    assert err.value.missing_blocks == [2, 3, 4, 5, 6, 7]
    assert "blocks 2..3: no server announces them" in text
    assert "blocks 4..5 have no usable server: peer J is JOINING" in text
    assert "blocks 6..7 have no usable server: peer B is banned: it failed recently" in text


def test_no_route_names_a_server_too_small_for_the_session():
    spans = swarm(span("A", 0, 4))
    spans["A"] = RemoteSpanInfo("A", 0, 4, spans["A"].server_info.model_copy(update={"cache_tokens_total": 100}))
    with pytest.raises(NoRouteError, match="peer A cannot hold a session of 500 tokens"):
        find_route(spans, 0, 4, cache_tokens_needed=500)


def test_no_route_splits_ranges_by_their_holders_and_caps_the_names():
    spans = swarm(*(span(f"P{i}", 0, 2) for i in range(5)), span("Q", 1, 3))
    with pytest.raises(NoRouteError) as err:
        find_route(spans, 0, 3, banned={"P0", "P1", "P2", "P3", "P4", "Q"})
    text = str(err.value)
    assert "block 0 has no usable server" in text and "and 2 more" in text  # P0..P2 named, 2 counted
    assert "block 2 has no usable server: peer Q is banned" in text


def test_ban_list_keeps_the_reason_until_a_success():
    bans = BanList(base=1.0, max_ban=8.0)
    bans.ban("A", now=0.0, reason="refused")
    bans.ban("B", now=0.0)
    assert bans.reasons(now=0.5) == {"A": "refused"}
    assert bans.reasons(now=5.0) == {}  # no longer banned
    assert bans.reason("A") == "refused"  # kept for the next ban's context
    bans.report_success("A")
    assert bans.reason("A") is None


# --- ping budget (pings) ----------------------------------------------------------------------------------


def test_pings_cover_blocks_when_measured_peers_hold_every_usable_block():
    from swarm_client.pings import covered

    spans = swarm(span("A", 0, 2), span("B", 2, 4), span("N", 2, 4), span("J", 4, 6, state=ServerState.JOINING))
    assert covered(spans, measured={"A", "B"}, banned=())  # N not needed; J is not usable
    assert not covered(spans, measured={"A"}, banned=())
    assert covered(spans, measured={"A"}, banned={"B", "N"})  # what is banned need not be measured


def test_ping_grace_is_a_multiple_of_the_fastest_answer_capped():
    from swarm_client.pings import grace

    assert grace(None, 0.3, 3.0) == 0.3
    assert grace(0.002, 0.3, 3.0) == pytest.approx(0.006)
    assert grace(0.5, 0.3, 3.0) == 0.3


def test_ping_failure_reason_hints_at_nat_for_a_timeout_only():
    from swarm_client.errors import PeerError, PeerTimeout
    from swarm_client.pings import ping_failure_reason

    text = ping_failure_reason(PeerTimeout("x"), 3.0, ("/ip4/10.232.0.2/tcp/31330",))
    assert "within 3.0 s (announces /ip4/10.232.0.2/tcp/31330)" in text and "--public-ip" in text
    assert "NAT" not in ping_failure_reason(PeerError("connection refused"), 3.0)
    # a server announcing only loopback addresses runs on this machine: no NAT hint (issue 40)
    local = ping_failure_reason(PeerTimeout("x"), 3.0, ("/ip4/127.0.0.1/tcp/31330", "/ip6/::1/tcp/31330"))
    assert "--public-ip" not in local and "on this machine" in local, local
    mixed = ping_failure_reason(PeerTimeout("x"), 3.0, ("/ip4/127.0.0.1/tcp/1", "/ip4/10.232.0.2/tcp/1"))
    assert "--public-ip" in mixed


def test_settle_stops_waiting_on_a_silent_peer_once_others_cover_the_blocks():
    """A fake ping coroutine stands in for the transport: the decision logic is what is tested here."""
    import asyncio
    import time

    from swarm_client.pings import Pinger

    rtt: dict[str, float] = {}
    bans: set[str] = set()

    async def ping(peer: str, _span: object) -> None:
        if peer == "silent":
            await asyncio.sleep(2.0)
            bans.add(peer)
        else:
            await asyncio.sleep(0.01)
            rtt[peer] = 0.01

    async def main() -> tuple[float, set[str], float, set[str]]:
        pinger = Pinger(ping, rtt, ping_timeout=2.0, ping_grace=0.3, ping_grace_factor=3.0)
        spans = swarm(span("fast", 0, 4), span("silent", 0, 4))
        t0 = time.monotonic()
        pinger.start(spans, bans)
        await pinger.settle(spans, lambda: bans)
        settled, pending = time.monotonic() - t0, pinger.pending()
        alone = swarm(span("silent", 0, 4))  # the only server: settle waits for its ping to end
        await pinger.settle(alone, lambda: bans)
        return settled, pending, time.monotonic() - t0, set(bans)

    settled, pending, total, banned = asyncio.run(main())
    print(f"settled beside a silent peer after {settled:.3f}s; alone: {total:.3f}s")
    assert settled < 1.0 and pending == {"silent"}  # generous: 0.03 s expected
    assert total >= 1.5 and banned == {"silent"}
