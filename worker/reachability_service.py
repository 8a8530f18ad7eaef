"""The checker side of the start-up reachability check: ``ReachabilityService.rpc_check_reachability``.

A server (or ``swarmserve dht``) that is reachable answers a newcomer's question "can you dial me at these
addresses?" by dialing the *caller's own* peer id (``context.remote_id``; the request names no peer) from a
separate probe ``P2P`` that has no connection to the caller, so the answer is about the announced addresses
and not about the connection the question came on (Petals' approach, without its central web service).

The RPC makes a stranger's node dial addresses, so everything is bounded and every refusal is an answer
(``{"reachable": None, "error": <code>}``), never an exception: at most ``MAX_MADDRS`` multiaddrs of at most
``MAX_MADDR_CHARS`` characters, each ``/ip4|ip6|dns|dns4|dns6/<host>/tcp/<port>`` with an optional
``/p2p/<the caller's id>``; one check per caller at a time and one per ``per_peer_interval`` (the limiter
remembers at most ``max_tracked`` callers); at most ``max_concurrent`` checks at once; a bounded dial.

A relay check (worker/relay.py) sends circuit addresses instead, all of them
``<host>/tcp/<port>/p2p/<relay>/p2p-circuit`` (optionally ``/p2p/<the caller's id>``): they are dialed from a
second probe that has the circuit transport, written as the bytes go-multiaddr reads (hivemind's Multiaddr
encodes ``/p2p/`` values as CIDs, which p2pd rejects), and rate-limited apart from direct checks.

Wire (unary, ``runtime_pb2.ExpertInfo`` both ways, msgpack in ``serialized_info``):
    caller → {"maddrs": ["/ip4/203.0.113.7/tcp/31330", ...]}
    checker → {"reachable": true | false | null, "error": null | "<code>: <detail>"}
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

from swarm_client import protocol

__all__ = ["MAX_MADDRS", "MAX_MADDR_CHARS", "ReachabilityService", "circuit_maddr", "parse_caller_maddrs"]

logger = logging.getLogger(__name__)

MAX_MADDRS = 8
MAX_MADDR_CHARS = 256
HOST_PROTOCOLS = frozenset({"ip4", "ip6", "dns", "dns4", "dns6"})
#: refusal codes (the ``error`` of an answer with ``reachable: None``)
BAD_REQUEST, RATE_LIMITED, BUSY, ALREADY_CHECKING = "bad_request", "rate_limited", "busy", "already_checking"


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
    """Serve ``rpc_check_reachability`` on a p2p (``add_p2p_handlers``); ``close()`` on shutdown."""

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
        probe_idle_s: float = 60.0,
    ):
        self.dial_timeout = dial_timeout
        self.per_peer_interval = per_peer_interval
        self.max_concurrent = max_concurrent
        self.max_tracked = max_tracked
        self.probe_idle_s = probe_idle_s
        self._last_check: OrderedDict[str, float] = OrderedDict()  # caller → when its last check began
        self._running: set[str] = set()
        self._probes: dict[bool, P2P] = {}  # relayed? → its probe
        self._probe_lock = asyncio.Lock()
        self._probe_used = 0.0
        self._reaper: asyncio.Task | None = None
        #: answers given so far by outcome ("reachable", "unreachable", or a refusal code), for tests and logs
        self.answers: dict[str, int] = {}

    async def rpc_check_reachability(
        self, request: runtime_pb2.ExpertInfo, context: P2PContext
    ) -> runtime_pb2.ExpertInfo:
        caller = context.remote_id.to_base58()
        try:
            reachable, error = await self._check(request, caller)
        except Exception as exc:  # never let one request hurt the node serving it
            logger.warning("reachability check for %s failed: %r", caller, exc)
            reachable, error = None, f"{BUSY}: check failed on the checker"
        outcome = {True: "reachable", False: "unreachable"}.get(reachable) or (error or "").split(":")[0]
        self.answers[outcome] = self.answers.get(outcome, 0) + 1
        payload = {"reachable": reachable, "error": error}
        return runtime_pb2.ExpertInfo(serialized_info=protocol.pack_metadata(payload))

    async def _check(self, request: runtime_pb2.ExpertInfo, caller: str) -> tuple[bool | None, str | None]:
        try:
            metadata = protocol.unpack_metadata(request.serialized_info)
            maddrs = parse_caller_maddrs(metadata.get("maddrs"), caller)
            relayed = is_circuit_request(metadata.get("maddrs"))
        except BadRequest as exc:
            return None, f"{BAD_REQUEST}: {exc}"
        except Exception:
            return None, f"{BAD_REQUEST}: metadata must be a msgpack map"
        key = f"{caller}/relay" if relayed else caller  # a relay check follows a direct one within seconds
        refusal = self._admit(key)
        if refusal is not None:
            return None, refusal
        self._running.add(key)
        try:
            return await self._dial(caller, maddrs, relayed)
        finally:
            self._running.discard(key)

    def _admit(self, caller: str) -> str | None:
        """None if ``caller`` may be checked now (and note it), else the refusal."""
        if caller in self._running:
            return f"{ALREADY_CHECKING}: one check per peer at a time"
        if len(self._running) >= self.max_concurrent:
            return f"{BUSY}: {self.max_concurrent} checks already running; ask another peer or later"
        now = time.monotonic()
        while self._last_check and now - next(iter(self._last_check.values())) >= self.per_peer_interval:
            self._last_check.popitem(last=False)  # oldest first: the dict is in check order
        last = self._last_check.get(caller)
        if last is not None:
            wait = self.per_peer_interval - (now - last)
            return f"{RATE_LIMITED}: one check per {self.per_peer_interval:g} s; retry in {wait:.1f} s"
        if len(self._last_check) >= self.max_tracked:
            return f"{BUSY}: too many peers checked in the last {self.per_peer_interval:g} s"
        self._last_check[caller] = now
        return None

    async def _dial(self, caller: str, maddrs: list[Multiaddr], relayed: bool = False) -> tuple[bool, str | None]:
        probe = await self._get_probe(relayed)
        peer = PeerID.from_base58(caller)
        try:
            await asyncio.wait_for(probe._client.connect(peer, maddrs), self.dial_timeout)  # noqa: SLF001
            return True, None
        except TimeoutError:
            return False, f"no connection within {self.dial_timeout:g} s"
        except Exception as exc:
            return False, f"dial failed: {str(exc)[:300]}"
        finally:
            self._probe_used = time.monotonic()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(probe._client.disconnect(peer), 2.0)  # noqa: SLF001

    async def _get_probe(self, relayed: bool = False) -> P2P:
        """A probe p2p: created on first use (a fresh daemon, no connection to anybody), kept while used."""
        async with self._probe_lock:
            probe = self._probes.get(relayed)
            if probe is None or not probe.is_alive:
                self._probes[relayed] = probe = await _ProbeP2P.create(
                    dht_mode="off", no_listen=True, auto_nat=False, nat_port_map=False, use_relay=relayed
                )
                self._reaper = self._reaper or asyncio.create_task(self._close_when_idle())
            self._probe_used = time.monotonic()
            return probe

    async def _close_when_idle(self) -> None:
        while True:
            await asyncio.sleep(min(self.probe_idle_s, 10.0))
            async with self._probe_lock:
                idle = time.monotonic() - self._probe_used >= self.probe_idle_s
                if not idle or self._running or not self._probes:
                    continue
                probes, self._probes = list(self._probes.values()), {}
            for probe in probes:
                await probe.shutdown()

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        probes, self._probes = list(self._probes.values()), {}
        for probe in probes:
            await probe.shutdown()
