"""Serve through a libp2p circuit relay when the start-up reachability check says nobody can dial us.

A worker the check finds unreachable (``--relay auto``, the default) restarts its DHT node — same identity, so
the same peer id and the same records — with go-libp2p's autorelay on and the initial peers as its only
("static") relays (``relay_dht_kwargs``). The relay holds a circuit v2 reservation for us and we gain a
``<relay maddr>/p2p/<relay>/p2p-circuit`` address (``wait_for_circuit``); clients find it through libp2p's kad
DHT when they dial our peer id, so no swarmserve record needs to carry it. We go ONLINE (``RELAYED``) only once a
checker has dialed us through it (``verify_circuits``). Findings behind each choice:
load_tests/results/relay-findings-2026-12-06.md.

The hack: hivemind 1.1.12's ``P2P.create`` cannot pass p2pd's ``-relayDiscovery=0``. Without it autorelay
waits for 4 relay candidates or a 3-minute boot delay; with it the circuit appears within seconds.
``enable_static_relays`` adds one entry to ``P2P.FORCE_REACHABILITY_MAPPING`` (the dict ``P2P.create`` turns
into daemon flags for its ``force_reachability`` kwarg): ``force_reachability=STATIC_RELAYS`` then means
``-forceReachabilityPrivate=1 -relayDiscovery=0``. It is set in this process only, before the DHT starts;
hivemind's ``DHT`` is a ``ForkProcess``, so its child (which creates the P2P) inherits the entry.

Limits: relays must have a public IP (go-libp2p builds circuit addresses only from a relay's public
addresses); a relay AutoNAT has not yet found public caps each circuit at 128 KiB and 2 min; one that has,
at p2pd's 4 GiB and 30 min per relayed connection (a client reconnects after that); every activation of a
relayed session passes the relay unless DCUtR hole-punches a direct connection.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Sequence

from hivemind.p2p import P2P

from swarm_client.dht_records import Reachability
from worker.reachability import ReachabilityResult, check_reachability

__all__ = [
    "CIRCUIT_WAIT",
    "RELAY_BUDGET",
    "STATIC_RELAYS",
    "VERIFY_RESERVE",
    "circuit_maddrs",
    "enable_static_relays",
    "public_relays",
    "relay_dht_kwargs",
    "relay_of",
    "verify_circuits",
    "wait_for_circuit",
]

logger = logging.getLogger(__name__)

#: a ``force_reachability`` value of our own: private, with static relays (see the module docstring)
STATIC_RELAYS = "private-static-relays"
#: the longest we wait for a circuit address (0–4 s where a relay can serve one)
CIRCUIT_WAIT = 20.0
#: seconds after the DHT node is up by which the check and the relay attempt must be done
RELAY_BUDGET = 25.0
#: kept for the checkers' answer out of ``RELAY_BUDGET`` when waiting for a circuit
VERIFY_RESERVE = 6.0


def enable_static_relays() -> None:
    """Make ``P2P.create(force_reachability=STATIC_RELAYS)`` pass ``-forceReachabilityPrivate=1
    -relayDiscovery=0`` to p2pd (in this process and the DHT processes it forks afterwards)."""
    if STATIC_RELAYS not in P2P.FORCE_REACHABILITY_MAPPING:
        flags = {"forceReachabilityPrivate": 1, "relayDiscovery": 0}
        P2P.FORCE_REACHABILITY_MAPPING = {**P2P.FORCE_REACHABILITY_MAPPING, STATIC_RELAYS: flags}


def public_relays(initial_peers: Sequence[str]) -> list[str]:
    """The initial peers that can be our relays: with a peer id, at a DNS name or a global IP address
    (go-libp2p builds circuit addresses only from a relay's public addresses: a private one never yields one)."""
    out = []
    for peer in map(str, initial_peers):
        parts = peer.split("/")
        if "/p2p/" not in peer or len(parts) < 3:
            continue
        if parts[1] in ("ip4", "ip6"):
            try:
                if not ipaddress.ip_address(parts[2]).is_global:
                    continue
            except ValueError:
                continue
        elif not parts[1].startswith("dns"):
            continue
        out.append(peer)
    return out


def relay_dht_kwargs(relays: Sequence[str]) -> dict:
    """Extra ``DHT(...)`` kwargs for a node reachable only through ``relays`` (full maddrs, ``public_relays``)."""
    enable_static_relays()
    return {"use_auto_relay": True, "force_reachability": STATIC_RELAYS, "trusted_relays": list(relays)}


def circuit_maddrs(visible: Sequence[object]) -> list[str]:
    """Our ``<relay maddr>/p2p/<relay>/p2p-circuit`` addresses (without our own ``/p2p/<id>``), deduplicated."""
    out: list[str] = []
    for maddr in visible:
        text = str(maddr)
        if "/p2p-circuit" in text:
            circuit = text.split("/p2p-circuit", 1)[0] + "/p2p-circuit"
            if circuit not in out:
                out.append(circuit)
    return out


def relay_of(circuit: str) -> str:
    """The relay's peer id in a circuit address."""
    return circuit.split("/p2p-circuit", 1)[0].rsplit("/p2p/", 1)[1]


async def wait_for_circuit(dht, timeout: float) -> list[str]:
    """Poll the DHT node's visible maddrs (refreshed) until one is a circuit, or ``timeout``: [] then."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(0.0, timeout)
    while True:
        try:
            visible = await asyncio.wait_for(asyncio.to_thread(dht.get_visible_maddrs, latest=True), 5.0)
        except Exception as exc:  # a slow daemon: try again while there is time
            logger.debug("relay: visible maddrs unavailable: %r", exc)
            visible = []
        if circuits := circuit_maddrs(visible):
            return circuits
        if loop.time() >= deadline:
            return []
        await asyncio.sleep(min(0.5, max(0.0, deadline - loop.time())))


async def verify_circuits(
    p2p: P2P, circuits: Sequence[str], initial_peers: Sequence[str], timeout: float, **dht_kw
) -> ReachabilityResult:
    """Ask checkers to dial us through ``circuits`` (``worker.reachability_service`` accepts circuit addresses);
    the result's ``reachability`` is ``RELAYED`` where one did."""
    result = await check_reachability(p2p, circuits, initial_peers, ask_timeout=timeout, **dht_kw)
    return result.with_direct_as(Reachability.RELAYED)
