"""``rpc_check_reachability`` cannot be aimed (the audit's reach_probe.py, as tests): real libp2p daemons, TCP
sinks that count the connections the checker makes.

- a caller that is not on the checker's loopback (it connects from the machine's own non-loopback address)
  cannot aim a check at 127.0.0.1 or at a private network the checker is not on: no connection is made;
- a check dials once, however many addresses it names, and a closed port, an open non-libp2p one and the
  caller's own address read the same, after the same time;
- Sybil peer ids from one address share one budget.
tests/test_reachability.py keeps the legitimate checks (loopback callers are dialed as before).
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import socket
import time
from collections.abc import AsyncIterator

import psutil
import pytest
from hivemind.p2p import P2P

from tests.test_reachability import ask, closed_port
from worker.reachability_service import NOT_DIALABLE, UNREACHABLE, ReachabilityService

pytestmark = pytest.mark.slow

DIAL_TIMEOUT = 1.5


class Sinks:
    """TCP listeners that count the connections they get."""

    def __init__(self) -> None:
        self.connections: collections.Counter[int] = collections.Counter()
        self.servers: list[asyncio.Server] = []

    async def open(self, host: str, count: int) -> list[int]:
        ports = []
        for _ in range(count):
            server = await asyncio.start_server(self._accept, host, 0)
            self.servers.append(server)
            ports.append(server.sockets[0].getsockname()[1])
        return ports

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections[writer.get_extra_info("sockname")[1]] += 1
        writer.close()

    def close(self) -> None:
        for server in self.servers:
            server.close()


def own_lan_ip() -> str | None:
    """This machine's first non-loopback IPv4 address (a caller connecting to it is not seen on loopback)."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not ipaddress.ip_address(address.address).is_loopback:
                return address.address
    return None


@pytest.fixture
async def checker() -> AsyncIterator[tuple[P2P, ReachabilityService]]:
    p2p = await P2P.create(host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    service = ReachabilityService(dial_timeout=DIAL_TIMEOUT, per_peer_interval=30.0, host_burst=3, host_refill=30.0)
    await service.add_p2p_handlers(p2p)
    sinks = Sinks()
    try:
        yield p2p, service, sinks
    finally:
        sinks.close()
        await service.close()
        await p2p.shutdown()


async def test_a_caller_not_on_loopback_cannot_aim_at_local_or_foreign_private_ports(checker):
    checker_p2p, service, sinks = checker
    lan = own_lan_ip()
    if lan is None:
        pytest.skip("no non-loopback IPv4 address on this machine")
    local = await sinks.open("127.0.0.1", 2)
    own = await sinks.open(lan, 1)
    via_lan = [m for m in await checker_p2p.get_visible_maddrs() if f"/ip4/{lan}/" in str(m)]
    callers = [await P2P.create(initial_peers=via_lan) for _ in range(3)]
    try:
        answer = await ask(callers[0], checker_p2p, [f"/ip4/127.0.0.1/tcp/{p}" for p in local])
        assert answer == {"reachable": False, "error": NOT_DIALABLE}
        answer = await ask(callers[1], checker_p2p, ["/ip4/10.99.0.1/tcp/6379", "/dns4/localhost/tcp/5432"])
        assert answer == {"reachable": False, "error": NOT_DIALABLE}
        assert service.dials == 0 and not sinks.connections
        # its own observed address is dialed: once, and it is not a libp2p peer there
        answer = await ask(callers[2], checker_p2p, [f"/ip4/127.0.0.1/tcp/{local[0]}", f"/ip4/{lan}/tcp/{own[0]}"])
        assert answer == {"reachable": False, "error": UNREACHABLE}
        assert service.dials == 1 and dict(sinks.connections) == {own[0]: 1}
    finally:
        for p2p in callers:
            await p2p.shutdown()


async def test_one_dial_per_check_and_answers_that_tell_nothing(checker):
    checker_p2p, service, sinks = checker
    ports = await sinks.open("127.0.0.1", 8)
    loopback = [m for m in await checker_p2p.get_visible_maddrs() if "/ip4/127.0.0.1/" in str(m)]
    callers = [await P2P.create(initial_peers=loopback) for _ in range(2)]
    try:
        answers, took = [], []
        for caller, maddrs in zip(
            callers, ([f"/ip4/127.0.0.1/tcp/{p}" for p in ports], [f"/ip4/127.0.0.1/tcp/{closed_port()}"]), strict=True
        ):
            began = time.monotonic()
            answers.append(await ask(caller, checker_p2p, maddrs))
            took.append(time.monotonic() - began)
        assert answers == [{"reachable": False, "error": UNREACHABLE}] * 2  # open non-libp2p == closed
        assert all(t >= DIAL_TIMEOUT - 0.05 for t in took), took  # a refused port is not answered sooner
        assert service.dials == 2 and sum(sinks.connections.values()) == 1, sinks.connections
    finally:
        for p2p in callers:
            await p2p.shutdown()


async def test_sybil_ids_from_one_address_share_one_budget(checker):
    checker_p2p, service, sinks = checker
    ports = await sinks.open("127.0.0.1", 8)
    loopback = [m for m in await checker_p2p.get_visible_maddrs() if "/ip4/127.0.0.1/" in str(m)]
    sybils = [await P2P.create(initial_peers=loopback) for _ in range(8)]
    try:
        maddrs = [f"/ip4/127.0.0.1/tcp/{p}" for p in ports]
        first = await asyncio.gather(*(ask(p, checker_p2p, maddrs) for p in sybils))
        second = await asyncio.gather(*(ask(p, checker_p2p, maddrs) for p in sybils))
        dialed = [a for a in first + second if a["reachable"] is False]
        refused = [a for a in first + second if a["reachable"] is None]
        assert len(dialed) <= 3 and len(dialed) + len(refused) == 16, first + second
        assert all(a["error"].split(":")[0] in ("rate_limited", "busy", "already_checking") for a in refused)
        assert service.dials == len(dialed) == sum(sinks.connections.values())
    finally:
        for p2p in sybils:
            await p2p.shutdown()
