"""Issue 35, "load is not death", at the client's decisions (``SequenceManager`` with a swarm view set by hand,
no network): one ban per failure however many sessions saw it, an answer lifts a ban, slowness never bans
the only server of a block, and the watchdog resets a view in which every ONLINE server is banned."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from swarm_client.dht_records import RemoteSpanInfo, ServerInfo, ServerState
from swarm_client.errors import PeerError, PeerTimeout
from swarm_client.sequence_manager import ClientConfig, SequenceManager
from swarm_client.watchdog import wedged_blocks


def span(peer_id: str, start: int, end: int, state: ServerState = ServerState.ONLINE) -> RemoteSpanInfo:
    info = ServerInfo(state=state, start_block=start, end_block=end, throughput=100.0, cache_tokens_left=10_000)
    return RemoteSpanInfo(peer_id, start, end, info)


def manager(*spans: RemoteSpanInfo) -> SequenceManager:
    m = SequenceManager(ClientConfig(initial_peers=[], dht_prefix="m", num_blocks=4), dht=object())
    m.spans = {s.peer_id: s for s in spans}
    return m


def test_sixteen_sessions_failing_on_one_server_make_one_ban_step() -> None:
    m = manager(span("A", 0, 2), span("B1", 2, 4), span("B2", 2, 4))
    dead = PeerError("server B1 closed the stream", "B1")
    assert all(m.fault("B1", dead) for _ in range(16))
    assert m.bans.decisions == 1 and m.bans.failures("B1") == 1
    assert m.bans.remaining("B1") <= m.config.ban_base


def test_a_server_that_answers_inference_is_unbanned() -> None:
    m = manager(span("A", 0, 2), span("B1", 2, 4), span("B2", 2, 4))
    m.fault("B1", PeerError("refused", "B1"))
    assert "B1" in m.bans.banned()
    m.answered("B1")  # what InferenceSession does after every step a server answers
    assert "B1" not in m.bans.banned() and m.bans.failures("B1") == 0


def test_the_only_server_of_a_span_is_not_banned_for_a_slow_ping() -> None:
    m = manager(span("A", 0, 2), span("B", 2, 4))
    timeout = PeerTimeout("peer A did not answer info within 3.0s", "A")
    assert m.fault("A", timeout) is False
    assert m.bans.banned() == set()
    assert m.liveness.timings("A")["slow"]["times"] == 1  # what /v1/swarm shows
    m.answered("A", 0.5)
    assert "slow" not in m.liveness.timings("A")


def test_the_only_server_is_banned_on_evidence_of_death() -> None:
    m = manager(span("A", 0, 2), span("B", 2, 4))
    assert m.fault("A", PeerError("server A closed the stream", "A")) is True
    assert m.bans.banned() == {"A"}


def test_a_slow_server_with_a_live_replica_is_banned_for_one_backoff_from_its_latency() -> None:
    m = manager(span("A", 0, 2), span("B1", 2, 4), span("B2", 2, 4))
    m.liveness.answered("B1", 2.0)  # its pings take 2 s under this load
    assert m.fault("B1", PeerTimeout("silent", "B1")) is True
    assert 7.9 < m.bans.remaining("B1") <= 8.0  # 4 × its latency, not 1 s then 60 s
    assert m.fault("B2", PeerTimeout("silent", "B2")) is False  # now the last usable server of 2..3


def test_wedged_blocks_are_served_but_unusable() -> None:
    spans = {s.peer_id: s for s in (span("A", 0, 2), span("B", 2, 4), span("J", 0, 2, ServerState.JOINING))}
    assert wedged_blocks(spans, {"A"}, 4) == [0, 1]
    assert wedged_blocks(spans, set(), 4) == []
    assert wedged_blocks({"A": spans["A"]}, set(), 4) == []  # 2..3 missing: not a wedge, a gap


async def test_watchdog_resets_a_view_where_every_online_server_is_banned(caplog) -> None:
    m = manager(span("A", 0, 2), span("B1", 2, 4), span("B2", 2, 4))
    for peer in ("A", "B1", "B2"):
        for _ in range(7):  # the audit's wedge: 60 s bans, renewed
            m.bans.ban(peer, now=0.0 + 1000 * _, reason="did not answer a ping within 3.0 s")
        m.bans.ban(peer, reason="did not answer a ping within 3.0 s")
    m.rtt.update({"A": 0.01})
    assert await m.watchdog.check(now=100.0) is False  # noticed, not yet held for `after` seconds
    with caplog.at_level(logging.WARNING, logger="swarm_client.watchdog"):
        assert await m.watchdog.check(now=100.0 + m.watchdog.after) is True
    assert m.bans.banned() == set() and m.rtt == {}
    assert m.watchdog.resets == 1 and "blocks 0..3" in (m.watchdog.last_reason or "")
    assert "resetting the client's view" in caplog.text
    assert await m.watchdog.check(now=200.0) is False  # healthy now


async def test_watchdog_counts_a_ping_stuck_past_its_timeout_as_unusable() -> None:
    m = manager(span("A", 0, 4))
    never = asyncio.get_running_loop().create_future()

    async def hang(peer: str, _span: RemoteSpanInfo) -> None:
        await never

    m.pings._ping = hang
    m.pings.start(m.spans, set())
    m.pings.started["A"] -= m.config.ping_timeout + 1.0
    assert m.watchdog.wedged() == [0, 1, 2, 3]
    await m.watchdog.check(now=0.0)
    assert await m.watchdog.check(now=m.watchdog.after) is True
    assert m.pings.pending() == set()
    await asyncio.sleep(0)


@pytest.mark.parametrize("answered", [True, False])
def test_a_missed_liveness_ping_does_not_count_while_the_server_answers_others(answered: bool) -> None:
    m = manager(span("A", 0, 4))
    m.liveness.answered("A", now=10.0) if answered else None
    assert m.liveness.heard_since("A", 9.5) is answered


# --- the gateway's view: admission, /health, /v1/swarm --------------------------------------------------------


class _Backend:
    """The two attributes ``gateway.backends.swarm_view`` reads of a swarm backend."""

    model_id = "m"

    def __init__(self, m: SequenceManager):
        self.manager, self.num_blocks = m, m.config.num_blocks


def _cached(peer: str, start: int, end: int, left: int, total: int) -> RemoteSpanInfo:
    info = ServerInfo(
        state=ServerState.ONLINE, start_block=start, end_block=end, throughput=100.0,
        cache_tokens_left=left, cache_tokens_total=total, sessions_left=8,
    )  # fmt: skip
    return RemoteSpanInfo(peer, start, end, info)


def test_admission_counts_only_servers_the_client_can_route_to() -> None:
    from gateway.backends.swarm_view import backend_room

    m = manager(_cached("A", 0, 2, 4000, 4000), _cached("B1", 2, 4, 1000, 1000), _cached("B2", 2, 4, 3000, 3000))
    backend = _Backend(m)
    assert backend_room(backend).total == 4000
    m.fault("B2", PeerError("refused", "B2"))
    room = backend_room(backend)
    assert room.total == 1000 and room.largest == 1000 and room.free == 1000  # B2's cache is no room for us
    m.fault("B1", PeerError("refused", "B1"))  # nobody usable: the announced room; /health says unavailable
    assert backend_room(backend).total == 4000


async def test_health_is_unavailable_with_the_reason_when_no_route_can_be_made() -> None:
    from types import SimpleNamespace

    from gateway.backends.swarm_view import with_client_view
    from gateway.routes.health import health

    m = manager(span("A", 0, 2), span("B", 2, 4))
    m.fault("B", PeerError("server B closed the stream", "B"))
    rows = [{"peer_id": p, "start": s.start, "end": s.end, "state": "ONLINE"} for p, s in m.spans.items()]
    state = with_client_view({"num_blocks": 4, "missing_blocks": [], "spans": rows}, _Backend(m))
    assert state["unroutable_blocks"] == [2, 3] and "closed the stream" in state["unroutable_reason"]
    assert state["spans"][1]["ban"]["reason"] == "server B closed the stream"

    class View:
        async def get(self) -> dict:
            return state

    response = await health(View(), _Backend(m), SimpleNamespace(retry_after_s=2))
    assert response.status_code == 503
    body = json.loads(response.body)
    assert body["status"] == "unavailable" and body["unroutable_blocks"] == [2, 3] and "closed" in body["reason"]
