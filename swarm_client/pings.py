"""Measuring new peers without waiting on the slow ones: pings run in the background, routing waits for them
only as long as it needs to.

A client pings every ONLINE server it has not measured (new in the DHT, or whose ban ran out) to learn its RTT.
One unreachable server (announcing a private address behind NAT: the dial hangs until ``ping_timeout``) must
not hold up the others, so ``Pinger.settle`` returns as soon as the servers that answered (with those measured
before) hold every block some usable server holds and a short grace passed — ``ping_grace``, or
``ping_grace_factor`` × the fastest answer if that is less — and the pings still in flight go on: they record an
RTT or ban their peer (with the reason, for ``NoRouteError``) when they end. Routing leaves out peers whose
ping is still in flight while others can serve their blocks (``SequenceManager.make_route``), and waits for
them when they are the only option.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Callable, Collection, Coroutine, Mapping
from typing import Any

from swarm_client.dht_records import RemoteSpanInfo, ServerState
from swarm_client.errors import PeerError, PeerTimeout

__all__ = ["Pinger", "connected", "covered", "grace", "ping_failure_reason"]

#: extra time ``settle`` / ``wait`` allow past ``ping_timeout`` (a ping's own timeout ends it first)
_SLACK = 0.5


def _blocks(spans: Collection[RemoteSpanInfo]) -> set[int]:
    return {block for span in spans for block in range(span.start, span.end)}


def covered(spans: Mapping[str, RemoteSpanInfo], measured: Collection[str], banned: Collection[str]) -> bool:
    """The ``measured`` peers hold every block that some ONLINE, unbanned server of ``spans`` holds."""
    usable = {p: s for p, s in spans.items() if s.state == ServerState.ONLINE and p not in banned}
    return _blocks(usable.values()) <= _blocks([s for p, s in usable.items() if p in measured])


def grace(fastest: float | None, limit: float, factor: float) -> float:
    """How long after the pings started ``settle`` may stop waiting once the blocks are covered:
    ``factor`` × the fastest answer (a peer a little slower than the fastest is still measured), at most
    ``limit``; ``limit`` when nobody answered yet."""
    return limit if fastest is None else min(limit, factor * fastest)


def ping_failure_reason(error: PeerError, timeout: float, addrs: Collection[str] = (), connected: bool = False) -> str:
    """Why a peer is banned after its ping failed, as an operator should read it in ``NoRouteError``;
    ``connected``: the client held a live connection to it (then a timeout is load, not NAT)."""
    announces = f" (announces {', '.join(addrs)})" if addrs else ""
    if isinstance(error, PeerTimeout) and connected:
        return f"did not answer a ping within {timeout:.1f} s on a live connection: overloaded"
    if isinstance(error, PeerTimeout) and addrs and all(_is_loopback(a) for a in addrs):
        return (
            f"did not answer a ping within {timeout:.1f} s{announces}: a server on this machine, so overloaded, "
            "frozen or stopped (not NAT)"
        )
    if isinstance(error, PeerTimeout):
        return (
            f"did not answer a ping within {timeout:.1f} s{announces} — it may be behind NAT without a port "
            "forward; its operator should forward the port and pass --public-ip"
        )
    return f"failed a ping{announces}: {error}"


def _is_loopback(maddr: str) -> bool:
    """``/ip4/127.0.0.1/tcp/…`` or ``/ip6/::1/…``: an address only this machine can dial."""
    parts = maddr.split("/")
    if len(parts) < 3:
        return False
    try:
        return ipaddress.ip_address(parts[2]).is_loopback
    except ValueError:
        return False


async def connected(p2p: Any, peer_id: str) -> bool:
    """Whether ``p2p``'s daemon holds a live connection to ``peer_id``: a ping that timed out on a connected peer
    is slowness (a loaded machine), one that never got a connection is a failed dial (NAT, a dead host)."""
    try:
        peers = await asyncio.wait_for(p2p.list_peers(), timeout=2.0)
    except Exception:
        return False
    return any(str(info.peer_id) == peer_id for info in peers)


class Pinger:
    """Pings in flight, one per peer. ``ping(peer, span)`` is the coroutine that measures one peer of the swarm
    view being read (it records the RTT or bans the peer itself); ``rtt`` is the table the manager keeps its
    measured RTTs in."""

    def __init__(
        self,
        ping: Callable[[str, RemoteSpanInfo], Coroutine[Any, Any, None]],
        rtt: Mapping[str, float],
        ping_timeout: float,
        ping_grace: float,
        ping_grace_factor: float,
    ):
        self._ping = ping
        self.rtt = rtt
        self.ping_timeout = ping_timeout
        self.ping_grace = ping_grace
        self.ping_grace_factor = ping_grace_factor
        self.tasks: dict[str, asyncio.Task] = {}
        #: when each ping in flight started (monotonic): a ping far past its timeout is stuck (``stuck``)
        self.started: dict[str, float] = {}

    def pending(self) -> set[str]:
        """Peers whose ping is still in flight."""
        return {p for p, t in list(self.tasks.items()) if not t.done()}  # read off-loop too (/health)

    def stuck(self, timeout: float) -> set[str]:
        """Peers whose ping has been in flight for longer than ``timeout`` and a little: its own timeout should
        have ended it (watched by ``watchdog``; a ping that never ends would keep its peer out of routes)."""
        now = time.monotonic()
        return {p for p in self.pending() if now - self.started.get(p, now) > timeout + _SLACK}

    def start(self, spans: Mapping[str, RemoteSpanInfo], banned: Collection[str]) -> set[str]:
        """Ping every ONLINE, unbanned, unmeasured peer of ``spans`` not being pinged yet; returns the pending."""
        for peer, span in spans.items():
            if span.state != ServerState.ONLINE or peer in self.rtt or peer in banned or peer in self.tasks:
                continue
            task = asyncio.get_running_loop().create_task(self._ping(peer, span), name=f"ping {peer}")
            self.tasks[peer] = task
            self.started[peer] = time.monotonic()
            task.add_done_callback(lambda _, p=peer: (self.tasks.pop(p, None), self.started.pop(p, None)))
        return self.pending()

    async def settle(self, spans: Mapping[str, RemoteSpanInfo], banned: Callable[[], Collection[str]]) -> None:
        """Wait for the pings of ``spans``' peers until the measured peers cover the usable blocks and the grace
        passed (``grace``), or every ping ended, or ``ping_timeout``; the rest go on in the background."""
        started = time.monotonic()
        deadline = started + self.ping_timeout + _SLACK
        while True:
            waiting = [t for p, t in self.tasks.items() if p in spans and not t.done()]
            if not waiting:
                return
            now = time.monotonic()
            until = deadline
            if covered(spans, self.rtt, banned()):
                fastest = min((self.rtt[p] for p in spans if p in self.rtt), default=None)
                until = min(until, started + grace(fastest, self.ping_grace, self.ping_grace_factor))
            if now >= until:
                return
            await asyncio.wait(waiting, timeout=until - now, return_when=asyncio.FIRST_COMPLETED)

    async def wait(self, peers: Collection[str]) -> None:
        """Wait (at most ``ping_timeout`` and a little) until the pings of ``peers`` ended."""
        tasks = [t for p, t in self.tasks.items() if p in peers and not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=self.ping_timeout + _SLACK)

    def cancel(self) -> None:
        """Cancel every ping in flight (on the loop that runs them)."""
        for task in list(self.tasks.values()):
            task.get_loop().call_soon_threadsafe(task.cancel)
        self.tasks.clear()
        self.started.clear()
