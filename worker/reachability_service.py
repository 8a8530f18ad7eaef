"""The checker side of the start-up reachability check: ``ReachabilityService.rpc_check_reachability``.

A server (or ``swarmserve dht``) that is reachable answers a newcomer's question "can you dial me at these
addresses?" by dialing the *caller's own* peer id (``context.remote_id``; the request names no peer) from a
fresh probe ``P2P`` that has no connection to anybody, so the answer is about the announced addresses and not
about the connection the question came on (Petals' approach, without its central web service).

The RPC is unauthenticated and makes the checker dial, so it must not be a port scanner:

- where: ``worker.dial_policy`` — public addresses, the caller's observed IP, and private networks the checker
  is on and the caller is seen in (loopback only for a caller on loopback); DNS names resolved first;
- how much: ONE address per check (``choose_dial``), dialed from a probe made for that check alone (a reused
  probe's peerstore would keep earlier checks' addresses, and libp2p dials every address it knows);
- how often: ``worker.check_limits`` — per peer id, per caller IP (Sybil ids on one host share a budget), and
  at most ``max_concurrent`` at once;
- what it tells: reachable or not, nothing else. Every failure reads the same and comes ``dial_timeout``
  after the dial began, so a closed port, an open one and a silent one cannot be told apart.

Requests are bounded too: at most ``MAX_MADDRS`` multiaddrs of at most ``MAX_MADDR_CHARS`` characters, each
``/ip4|ip6|dns|dns4|dns6/<host>/tcp/<port>`` with an optional ``/p2p/<the caller's id>``. Refusals are answers
(``{"reachable": None, "error": <code>}``), never exceptions; addresses the policy will not dial are answered
``{"reachable": False, "error": "not_dialable: ..."}`` (the swarm could not dial them either).

A relay check (worker/relay.py) sends circuit addresses instead, all of them
``<host>/tcp/<port>/p2p/<relay>/p2p-circuit`` (optionally ``/p2p/<the caller's id>``; the policy applies to the
relay's address): they are dialed from a probe that has the circuit transport, written as the bytes
go-multiaddr reads (hivemind's Multiaddr encodes ``/p2p/`` values as CIDs, which p2pd rejects), and
rate-limited per peer apart from direct checks.

Wire (unary, ``runtime_pb2.ExpertInfo`` both ways, msgpack in ``serialized_info``):
    caller → {"maddrs": ["/ip4/203.0.113.7/tcp/31330", ...]}
    checker → {"reachable": true | false | null, "error": null | "<code>: <detail>"}
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

from swarm_client import protocol
from worker.check_limits import BUSY, CheckLimiter
from worker.dial_policy import IPNetwork, choose_dial, local_networks, observed_ips, resolve_hosts

__all__ = ["MAX_MADDRS", "MAX_MADDR_CHARS", "ReachabilityService", "circuit_maddr", "parse_caller_maddrs"]

logger = logging.getLogger(__name__)

MAX_MADDRS = 8
MAX_MADDR_CHARS = 256
HOST_PROTOCOLS = frozenset({"ip4", "ip6", "dns", "dns4", "dns6"})
BAD_REQUEST = "bad_request"  # refusal codes: this one, and check_limits' (answers with ``reachable: None``)
#: the two ``reachable: False`` answers: nothing dialable, or the one dial failed (whatever the reason)
NOT_DIALABLE = (
    "not_dialable: a checker dials only public addresses, the address you connect from, and private networks "
    "it shares with you"
)
UNREACHABLE = "unreachable: no libp2p connection to your peer id at the address dialed"


class BadRequest(ValueError):
    """A request the checker will not act on; its text goes back to the caller."""


CIRCUIT = "/p2p-circuit"


def circuit_maddr(relay_maddr: Multiaddr, relay: PeerID, target: PeerID) -> Multiaddr:
    """``<relay_maddr>/p2p/<relay>/p2p-circuit/p2p/<target>`` as the bytes go-multiaddr reads: the ``/p2p`` parts
    written by hand (code 421, a one-byte length, the bare multihash; ``a2 02`` is ``/p2p-circuit``)."""

    def p2p(peer: PeerID) -> bytes:
        mh = peer.to_bytes()
        return b"\xa5\x03" + bytes([len(mh)]) + mh

    return Multiaddr(relay_maddr.to_bytes() + p2p(relay) + b"\xa2\x02" + p2p(target))


def _host_tcp(text: str, caller: str | None) -> Multiaddr:
    """``/<host proto>/<host>/tcp/<port>``, without a trailing ``/p2p/<caller>`` (any other id: ``BadRequest``;
    ``caller`` None: the trailing ``/p2p/<id>`` is kept, whoever it names)."""
    try:
        maddr = Multiaddr(text)
        names = [p.name for p in maddr.protocols()]
        if names[-1:] == ["p2p"] and caller is not None:
            if maddr.value_for_protocol("p2p") != caller:
                raise BadRequest(f"{text}: names another peer; a checker dials only the caller")
            maddr = maddr.decapsulate(Multiaddr(f"/p2p/{caller}"))
            names = names[:-1]
        base = names[:-1] if caller is None and names[-1:] == ["p2p"] else names
        port = maddr.value_for_protocol("tcp") if base[1:] == ["tcp"] else None
    except BadRequest:
        raise
    except Exception:  # multiaddr raises several types for malformed text
        raise BadRequest(f"{text[:80]!r} is not a multiaddr") from None
    if len(base) != 2 or base[0] not in HOST_PROTOCOLS or not port or int(port) == 0:
        raise BadRequest(f"{text}: want /ip4|ip6|dns|dns4|dns6/<host>/tcp/<port>")
    return maddr


def _circuit(text: str, caller: str) -> Multiaddr:
    head, _, tail = text.partition(CIRCUIT)
    if tail not in ("", f"/p2p/{caller}"):
        raise BadRequest(f"{text}: a circuit must end in /p2p-circuit or /p2p-circuit/p2p/<the caller>")
    relay_part = _host_tcp(head, None)
    if [p.name for p in relay_part.protocols()][-1:] != ["p2p"]:
        raise BadRequest(f"{text}: want <host>/tcp/<port>/p2p/<relay>/p2p-circuit")
    try:
        relay = PeerID.from_base58(relay_part.value_for_protocol("p2p"))
    except Exception:
        raise BadRequest(f"{text}: the relay's peer id is not valid") from None
    relay_maddr = relay_part.decapsulate(Multiaddr(f"/p2p/{relay.to_base58()}"))
    return circuit_maddr(relay_maddr, relay, PeerID.from_base58(caller))


def is_circuit_request(raw: object) -> bool:
    """Whether a request's maddrs are circuit addresses (a relay check)."""
    return isinstance(raw, list) and any(isinstance(text, str) and CIRCUIT in text for text in raw)


def parse_caller_maddrs(raw: object, caller: str) -> list[Multiaddr]:
    """The caller's multiaddrs (direct ones without any ``/p2p/`` part, circuits as go-readable bytes; all
    direct or all circuits), or ``BadRequest`` saying what is wrong."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("maddrs must be a non-empty list")
    if len(raw) > MAX_MADDRS:
        raise BadRequest(f"at most {MAX_MADDRS} maddrs, got {len(raw)}")
    if not all(isinstance(text, str) and len(text) <= MAX_MADDR_CHARS for text in raw):
        raise BadRequest(f"each maddr must be a string of at most {MAX_MADDR_CHARS} characters")
    relayed = [CIRCUIT in text for text in raw]
    if any(relayed) and not all(relayed):
        raise BadRequest("maddrs must be all direct or all circuits")
    if all(relayed):
        return [_circuit(text, caller) for text in raw]
    return [_host_tcp(text, caller) for text in raw]


class _ProbeP2P(P2P):
    """A p2p daemon that only dials: no libp2p DHT ("off"), so a failed dial is never retried at addresses
    found through routing (a DHT-enabled daemon looks the peer up and would reach it elsewhere); no
    listening, no NAT services; the circuit transport only in the relay checks' probe."""

    DHT_MODE_MAPPING = {**P2P.DHT_MODE_MAPPING, "off": {}}


class ReachabilityService(ServicerBase):
    """Serve ``rpc_check_reachability`` on a p2p (``add_p2p_handlers``); ``close()`` on shutdown.

    ``networks``: this machine's interface networks for the dial policy (default: read at start)."""

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        name = f"swarmserve.Reachability.{method_name}"
        return f"{namespace}::{name}" if namespace is not None else name

    def __init__(
        self,
        *,
        dial_timeout: float = 5.0,
        per_peer_interval: float = 10.0,
        max_concurrent: int = 4,
        max_tracked: int = 4096,
        host_burst: int = 6,
        host_refill: float = 5.0,
        networks: Sequence[IPNetwork] | None = None,
    ):
        self.dial_timeout = dial_timeout
        self.limits = CheckLimiter(
            per_peer_interval=per_peer_interval,
            host_burst=host_burst,
            host_refill=host_refill,
            max_concurrent=max_concurrent,
            max_tracked=max_tracked,
        )
        self.networks = list(networks) if networks is not None else local_networks()
        self._p2p: P2P | None = None  # the p2p the RPC is served on: who is connected from where
        self._probes: set[P2P] = set()  # in use now (each check dials from a fresh one)
        #: answers given so far by outcome ("reachable", "unreachable", or a refusal code), for tests and logs
        self.answers: dict[str, int] = {}
        #: dials made so far (each check makes at most one)
        self.dials = 0

    async def add_p2p_handlers(self, p2p: P2P, *args, **kwargs) -> None:
        self._p2p = p2p
        await super().add_p2p_handlers(p2p, *args, **kwargs)

    async def rpc_check_reachability(
        self, request: runtime_pb2.ExpertInfo, context: P2PContext
    ) -> runtime_pb2.ExpertInfo:
        caller = context.remote_id.to_base58()
        try:
            reachable, error = await self._check(request, context.remote_id)
        except Exception as exc:  # never let one request hurt the node serving it
            logger.warning("reachability check for %s failed: %r", caller, exc)
            reachable, error = None, f"{BUSY}: check failed on the checker"
        outcome = {True: "reachable", False: "unreachable"}.get(reachable) or (error or "").split(":")[0]
        self.answers[outcome] = self.answers.get(outcome, 0) + 1
        payload = {"reachable": reachable, "error": error}
        return runtime_pb2.ExpertInfo(serialized_info=protocol.pack_metadata(payload))

    async def _check(self, request: runtime_pb2.ExpertInfo, peer: PeerID) -> tuple[bool | None, str | None]:
        caller = peer.to_base58()
        try:
            metadata = protocol.unpack_metadata(request.serialized_info)
            maddrs = parse_caller_maddrs(metadata.get("maddrs"), caller)
            relayed = is_circuit_request(metadata.get("maddrs"))
        except BadRequest as exc:
            return None, f"{BAD_REQUEST}: {exc}"
        except Exception:
            return None, f"{BAD_REQUEST}: metadata must be a msgpack map"
        observed = await observed_ips(self._p2p, peer) if self._p2p is not None else []
        host = str(observed[0]) if observed else "relayed"  # callers without a direct connection share one
        key = f"{caller}/relay" if relayed else caller  # a relay check follows a direct one within seconds
        refusal = self.limits.admit(key, host)
        if refusal is not None:
            return None, refusal
        try:
            candidates = await resolve_hosts(maddrs, dns=not relayed)
            target = choose_dial(candidates, observed, self.networks)
            if target is None:
                return False, NOT_DIALABLE
            return await self._dial(peer, target, relayed)
        finally:
            self.limits.done(key, host)

    async def _dial(self, peer: PeerID, target: Multiaddr, relayed: bool) -> tuple[bool, str | None]:
        """One dial of ``target`` from a fresh probe (no addresses of earlier checks in its peerstore, so the
        dial goes nowhere else). Unreachable answers come ``dial_timeout`` after the dial began, whatever
        failed, so neither the answer nor its timing tells a closed port from an open or silent one."""
        began = time.monotonic()
        probe = await _ProbeP2P.create(
            dht_mode="off", no_listen=True, auto_nat=False, nat_port_map=False, use_relay=relayed
        )
        self._probes.add(probe)
        try:
            self.dials += 1
            await asyncio.wait_for(probe._client.connect(peer, [target]), self.dial_timeout)  # noqa: SLF001
            return True, None
        except Exception:  # refused, timed out, not libp2p, another peer id: all the same to the caller
            await asyncio.sleep(max(0.0, self.dial_timeout - (time.monotonic() - began)))
            return False, UNREACHABLE
        finally:
            self._probes.discard(probe)
            with contextlib.suppress(Exception):
                await probe.shutdown()

    async def close(self) -> None:
        probes, self._probes = list(self._probes), set()
        for probe in probes:
            with contextlib.suppress(Exception):
                await probe.shutdown()
