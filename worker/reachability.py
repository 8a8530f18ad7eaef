"""The asking side of the start-up reachability check: can the swarm dial the addresses this server announces?

``check_reachability`` asks up to ``MAX_CHECKERS`` peers at once — those named in ``--initial-peers``, then
ONLINE servers from the DHT, never itself — to dial it back (``worker.reachability_service``). The result:

- ``Reachability.DIRECT``: some checker dialed it;
- unreachable (``ReachabilityResult.unreachable``): at least one checker answered and none could dial it —
  the server must not go ONLINE as is: it tries a relay (worker/relay.py), else exits (``unreachable_message``);
- ``Reachability.UNKNOWN``: no checker answered (no initial peers, busy ones, or peers without the RPC).

The whole check is bounded (``DHT_READ_TIMEOUT`` + ``ASK_TIMEOUT``, about 13 s at worst).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

from swarm_client import protocol
from swarm_client.dht_records import Reachability, ServerState, fetch_block_records, spans_from_records
from worker.reachability_service import MAX_MADDRS, ReachabilityService

__all__ = [
    "CheckerAnswer",
    "ReachabilityResult",
    "check_reachability",
    "checker_candidates",
    "own_maddrs",
    "unreachable_message",
]

logger = logging.getLogger(__name__)

MAX_CHECKERS = 3
#: one checker's answer must come within this (its dial timeout is 5 s)
ASK_TIMEOUT = 8.0
DHT_READ_TIMEOUT = 5.0


@dataclass(frozen=True)
class CheckerAnswer:
    peer_id: str
    #: True: it dialed us; False: it could not; None: no answer (``error`` says why)
    reachable: bool | None
    error: str | None = None


@dataclass(frozen=True)
class ReachabilityResult:
    maddrs: tuple[str, ...]
    answers: tuple[CheckerAnswer, ...]
    #: what a successful dial means: DIRECT, or RELAYED when ``maddrs`` are circuit addresses
    via: Reachability = Reachability.DIRECT

    def with_direct_as(self, via: Reachability) -> ReachabilityResult:
        return replace(self, via=via)

    @property
    def unreachable(self) -> bool:
        """Some checker answered and none could dial us: nobody will reach the addresses we announce."""
        return any(a.reachable is False for a in self.answers) and not self.direct

    @property
    def direct(self) -> bool:
        return any(a.reachable for a in self.answers)

    @property
    def reachability(self) -> Reachability | None:
        """What to announce: DIRECT, UNKNOWN, or None (unreachable; the caller must not go ONLINE as is)."""
        if self.direct:
            return self.via
        return None if self.unreachable else Reachability.UNKNOWN

    def describe(self) -> str:
        """One line per checker: who tried and what it saw."""
        seen = {True: "dialed us", False: "could NOT dial us", None: "did not check"}
        return "\n".join(
            f"  - {a.peer_id}: {seen[a.reachable]}" + (f" ({a.error})" if a.error else "") for a in self.answers
        )


def own_maddrs(visible: Sequence[object]) -> list[str]:
    """Our visible multiaddrs without their ``/p2p/<id>`` part, deduplicated, at most ``MAX_MADDRS``."""
    out: list[str] = []
    for maddr in visible:
        text = str(maddr).split("/p2p/", 1)[0]
        if text not in out:
            out.append(text)
    return out[:MAX_MADDRS]


def _peer_of(maddr: str) -> str | None:
    try:
        return Multiaddr(maddr).value_for_protocol("p2p")
    except Exception:  # no /p2p/ part, or not a multiaddr
        return None


def checker_candidates(initial_peers: Sequence[str], online: Sequence[str], me: str) -> list[str]:
    """Who to ask: the initial peers first (shuffled), then ONLINE servers (shuffled), never ``me``."""
    first = [p for p in dict.fromkeys(filter(None, map(_peer_of, initial_peers))) if p != me]
    rest = [p for p in dict.fromkeys(online) if p != me and p not in first]
    random.shuffle(first)
    random.shuffle(rest)
    return first + rest


def _online_servers(dht, dht_prefix: str, num_blocks: int) -> list[str]:
    spans = spans_from_records(fetch_block_records(dht, dht_prefix, num_blocks))
    return [peer for peer, span in spans.items() if span.state == ServerState.ONLINE]


async def _ask(p2p: P2P, peer: str, maddrs: Sequence[str], timeout: float = ASK_TIMEOUT) -> CheckerAnswer:
    request = runtime_pb2.ExpertInfo(serialized_info=protocol.pack_metadata({"maddrs": list(maddrs)}))
    try:
        stub = ReachabilityService.get_stub(p2p, PeerID.from_base58(peer))
        response = await asyncio.wait_for(stub.rpc_check_reachability(request), timeout)
        answer = protocol.unpack_metadata(response.serialized_info)
    except TimeoutError:
        return CheckerAnswer(peer, None, f"no answer within {timeout:.3g} s")
    except Exception as exc:  # an older peer without the RPC, a peer gone, garbage
        return CheckerAnswer(peer, None, f"no answer: {str(exc)[:200] or type(exc).__name__}")
    reachable, error = answer.get("reachable"), answer.get("error")
    if not isinstance(reachable, bool):
        reachable = None
    return CheckerAnswer(peer, reachable, str(error)[:300] if error else None)


async def check_reachability(
    p2p: P2P,
    maddrs: Sequence[str],
    initial_peers: Sequence[str],
    *,
    dht=None,
    dht_prefix: str | None = None,
    num_blocks: int = 0,
    ask_timeout: float = ASK_TIMEOUT,
) -> ReachabilityResult:
    """Ask up to ``MAX_CHECKERS`` peers in parallel whether they can dial ``maddrs``; see the module docstring."""
    me = p2p.peer_id.to_base58()
    online: list[str] = []
    candidates = checker_candidates(initial_peers, online, me)
    if len(candidates) < MAX_CHECKERS and dht is not None and dht_prefix is not None and num_blocks > 0:
        try:
            read = asyncio.to_thread(_online_servers, dht, dht_prefix, num_blocks)
            online = await asyncio.wait_for(read, DHT_READ_TIMEOUT)
        except Exception as exc:
            logger.info("reachability check: could not read ONLINE servers from the DHT: %r", exc)
        candidates = checker_candidates(initial_peers, online, me)
    chosen = candidates[:MAX_CHECKERS]
    answers = await asyncio.gather(*(_ask(p2p, peer, maddrs, min(ask_timeout, ASK_TIMEOUT)) for peer in chosen))
    return ReachabilityResult(tuple(maddrs), tuple(answers))


def unreachable_message(result: ReachabilityResult, port: int, relay_failure: str | None = None) -> str:
    """What an unreachable server prints before it exits: what was tried, who tried, and the fixes;
    ``relay_failure``: why serving through a relay did not work either (None: it was not tried)."""
    port_text = str(port) if port else "P (a fixed --port)"
    relay = f"Relay attempt failed: {relay_failure}\n" if relay_failure else "Relaying was off (--relay off).\n"
    return (
        "swarmserve worker: NOT REACHABLE - no peer of the swarm could connect to this server, so clients "
        "could not use it; not going ONLINE.\n"
        f"Addresses tried (what this server announces): {' '.join(result.maddrs) or '(none)'}\n"
        f"Peers that tried:\n{result.describe()}\n"
        f"{relay}"
        "To fix it, make one of these addresses reachable:\n"
        f"  - forward TCP port {port_text} on your router to this machine and pass "
        f"--public-ip <your public IP> --port {port_text} (or --announce-maddrs /ip4/<public IP>/tcp/{port_text});\n"
        "  - in Docker: set PUBLIC_IP (and publish the port) in docker-compose.yml;\n"
        "  - for a private swarm on one LAN whose peers reach these addresses: --no-reachability-check."
    )


async def startup_check(
    p2p: P2P, visible: Sequence[object], initial_peers: Sequence[str], **dht_kw
) -> ReachabilityResult:
    """The worker's check at start-up (``check_reachability`` on its visible maddrs), with its log lines.

    ``dht_kw``: ``dht``, ``dht_prefix``, ``num_blocks`` for finding ONLINE servers to ask."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    result = await check_reachability(p2p, own_maddrs(visible), initial_peers, **dht_kw)
    took = loop.time() - began
    if result.reachability is Reachability.UNKNOWN:
        logger.warning(
            "reachability check: no peer could check whether the swarm reaches %s (%s); going on unchecked",
            " ".join(result.maddrs),
            "no peers to ask" if not result.answers else "; ".join(f"{a.peer_id}: {a.error}" for a in result.answers),
        )
    elif result.direct:
        checkers = sum(1 for a in result.answers if a.reachable)
        print(f"swarmserve worker: reachable directly (dialed back by {checkers} peer(s) in {took:.2f} s)", flush=True)
    return result
