"""The start-up reachability check on real libp2p daemons over loopback (worker/reachability*.py).

A checker serves ``rpc_check_reachability``; callers are separate ``P2P`` instances. What is checked: a
reachable caller is confirmed by a dial from the checker's probe (not over the caller's own connection), a
black-hole address is reported unreachable, hostile requests get typed refusals and the checker keeps
serving, and ``check_reachability`` turns answers into DIRECT / unreachable / UNKNOWN.
"""

from __future__ import annotations

import re
import socket
from collections.abc import AsyncIterator

import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from swarm_client import protocol
from swarm_client.dht_records import Reachability
from swarmserve.launcher import WORKER_READY
from worker.reachability import check_reachability, checker_candidates, own_maddrs, unreachable_message
from worker.reachability_service import ReachabilityService, parse_caller_maddrs

pytestmark = pytest.mark.slow


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released: connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def checker() -> AsyncIterator[tuple[P2P, ReachabilityService]]:
    p2p = await P2P.create()
    service = ReachabilityService(dial_timeout=3.0, per_peer_interval=30.0, max_concurrent=4)
    await service.add_p2p_handlers(p2p)
    try:
        yield p2p, service
    finally:
        await service.close()
        await p2p.shutdown()


async def caller_of(checker_p2p: P2P) -> P2P:
    return await P2P.create(initial_peers=await checker_p2p.get_visible_maddrs())


def initial_peer(p2p_maddrs: list) -> list[str]:
    return [str(m) for m in p2p_maddrs]


async def ask(caller: P2P, checker_p2p: P2P, maddrs: object) -> dict:
    request = runtime_pb2.ExpertInfo(serialized_info=protocol.pack_metadata({"maddrs": maddrs}))
    stub = ReachabilityService.get_stub(caller, checker_p2p.peer_id)
    response = await stub.rpc_check_reachability(request, timeout=15)
    return protocol.unpack_metadata(response.serialized_info)


async def test_reachable_black_hole_and_hostile_requests(checker):
    checker_p2p, service = checker
    good, bad, other = [await caller_of(checker_p2p) for _ in range(3)]
    try:
        mine = own_maddrs(await good.get_visible_maddrs())
        assert await ask(good, checker_p2p, mine) == {"reachable": True, "error": None}
        # the probe dialed and hung up: the checker's own p2p did not gain or lose the caller's connection
        assert service.answers == {"reachable": 1}

        hole = [f"/ip4/127.0.0.1/tcp/{closed_port()}"]
        answer = await ask(bad, checker_p2p, hole)
        assert answer["reachable"] is False and answer["error"], answer

        nine = [f"/ip4/127.0.0.1/tcp/{1000 + i}" for i in range(9)]
        hostile = {
            "nine": nine,
            "garbage": ["not a multiaddr"],
            "long": ["/dns4/" + "a" * 300 + "/tcp/1"],
            "udp": ["/ip4/127.0.0.1/udp/5"],
            "other_peer": [f"{mine[0]}/p2p/{checker_p2p.peer_id.to_base58()}"],
            "not_a_list": "x",
        }
        for name, maddrs in hostile.items():
            answer = await ask(other, checker_p2p, maddrs)
            assert answer["reachable"] is None and answer["error"].startswith("bad_request"), (name, answer)

        again = await ask(good, checker_p2p, mine)  # within per_peer_interval
        assert again["reachable"] is None and again["error"].startswith("rate_limited"), again
        # and it goes on serving others
        assert (await ask(other, checker_p2p, own_maddrs(await other.get_visible_maddrs())))["reachable"] is True
    finally:
        for p2p in (good, bad, other):
            await p2p.shutdown()


async def test_check_reachability_verdicts(checker):
    checker_p2p, _ = checker
    peers = initial_peer(await checker_p2p.get_visible_maddrs())
    caller = await caller_of(checker_p2p)
    hole_caller = await caller_of(checker_p2p)
    plain = await P2P.create()  # a peer without the RPC (an older server)
    try:
        result = await check_reachability(caller, own_maddrs(await caller.get_visible_maddrs()), peers)
        assert result.reachability == Reachability.DIRECT and not result.unreachable, result

        hole = [f"/ip4/127.0.0.1/tcp/{closed_port()}"]
        result = await check_reachability(hole_caller, hole, peers)
        assert result.unreachable and result.reachability is None, result
        message = unreachable_message(result, 31330)
        assert hole[0] in message and "--public-ip" in message and "forward TCP port 31330" in message
        assert checker_p2p.peer_id.to_base58() in message

        old = initial_peer(await plain.get_visible_maddrs())
        result = await check_reachability(caller, own_maddrs(await caller.get_visible_maddrs()), old)
        assert result.reachability == Reachability.UNKNOWN and result.answers[0].reachable is None, result
        assert (await check_reachability(caller, ["/ip4/127.0.0.1/tcp/1"], [])).reachability == Reachability.UNKNOWN
    finally:
        for p2p in (caller, hole_caller, plain):
            await p2p.shutdown()


def test_parse_caller_maddrs_and_candidates():
    me = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    parsed = parse_caller_maddrs([f"/ip4/10.0.0.1/tcp/5/p2p/{me}", "/dns4/host.example/tcp/7"], me)
    assert [str(m) for m in parsed] == ["/ip4/10.0.0.1/tcp/5", "/dns4/host.example/tcp/7"]
    peers = [f"/ip4/1.2.3.4/tcp/1/p2p/{me}", "/ip4/1.2.3.4/tcp/2"]  # myself, and one without a peer id
    other = PeerID.from_base58("QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupNKC").to_base58()
    assert checker_candidates(peers, [me, other], me) == [other]


def test_workers_check_at_start_up(tiny_llama):
    """Real processes on loopback: a worker announcing a black hole never goes ONLINE and exits naming the
    fix; with ``--no-reachability-check`` the same worker goes ONLINE (nobody asked to dial it)."""
    from tests.swarm_fixtures import Swarm

    hole = ["--throughput", "100", "--announce-maddrs", f"/ip4/127.0.0.1/tcp/{closed_port()}"]
    with Swarm(tiny_llama) as swarm:  # its `swarmserve dht` node is the checker
        refused = swarm.add_worker(*hole, blocks="0:4", wait=False)
        refused.wait_for(re.compile("--no-reachability-check"), timeout=60)  # the message's last line
        assert refused.popen.wait(timeout=30) != 0
        output = "\n".join(refused.lines)
        assert "NOT REACHABLE" in output and hole[-1] in output and "could NOT dial us" in output, output
        assert not any(line.startswith(WORKER_READY) for line in refused.lines), output

        swarm.add_worker(*hole, "--no-reachability-check", blocks="0:4", timeout=60)
