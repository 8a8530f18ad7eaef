"""The swarm as ``/health`` and ``/v1/swarm`` see it: the backend's ``swarm_state()``, read off the event
loop (a DHT read blocks on the network), one read at a time, and answered from memory while it is recent.

Probes are unauthenticated and come in floods (load balancers, status pages, attackers): every probe that
arrives while a read is in flight waits for that read instead of starting its own, and with a backend that
can say how old its view may be (``swarm_state(max_age_s=...)``: the swarm backend) a view at most
``STATE_MAX_AGE_S`` old answers without any read at all (half that age here, the other half the backend's:
its own view is shared with routing). A backend without that parameter (in-process,
tests' fakes) is read afresh for each probe that finds no read in flight. Failures are remembered like
answers: a DHT that cannot be read is not asked again by every probe of the same interval.

With a swarm backend the view also carries ``"cache"`` (``CacheRoom.as_dict``): per the most constrained
block, the KV cache the ONLINE servers announce in all, free now, and on the largest single server, and
the blocks where no server has room for a new session (``/health`` says "degraded" while there are any;
the gateway's admission, ``gateway/api/request_parts.py``, reads the same numbers).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from swarm_client.dht_records import ServerState

__all__ = ["STATE_MAX_AGE_S", "THREAD_NAME_PREFIX", "CacheRoom", "SwarmView", "backend_room", "cache_room",
           "reachability_label", "with_client_view", "with_quant"]  # fmt: skip

#: how old a swarm view ``/health`` and ``/v1/swarm`` may answer from (probes and pages poll them: one DHT
#: read per interval serves them all)
STATE_MAX_AGE_S = 2.0
#: the reading thread's name starts with this (tests look for it)
THREAD_NAME_PREFIX = "swarm-view"


def reachability_label(announced: object, banned: bool = False) -> str:
    """A server's reachability as ``/v1/swarm`` shows it: "unreachable from here" while this client bans it
    (it failed us, e.g. a dial or ping), else what the server announced (``direct`` / ``relayed`` /
    ``unknown``: its start-up check, ``worker/reachability.py``), or "not checked"."""
    if banned:
        return "unreachable from here"
    return str(getattr(announced, "value", announced)) if announced else "not checked"


#: a new session needs at least this many free token slots on a server (``worker/cache.py``'s first chunk)
NEW_SESSION_TOKENS = 64


@dataclass(frozen=True)
class CacheRoom:
    """The swarm's KV cache, in token slots, for its most constrained block (a request needs every block).

    ``total``: what the block's ONLINE servers announce in all (``cache_tokens_total``; a server that does
    not announce it counts with what it has free); ``largest``: the largest one server of that block holds
    (one choice is one session: it must fit a single server); ``free``: free now, in all; ``full_blocks``:
    blocks whose every server is out of room for a new session (cache or session slots)."""

    total: int
    largest: int
    free: int
    full_blocks: tuple[int, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens_total": self.total,
            "largest_server_tokens": self.largest,
            "tokens_free": self.free,
            "full_blocks": list(self.full_blocks),
        }


def cache_room(spans: Mapping[str, Any], num_blocks: int) -> CacheRoom | None:
    """``CacheRoom`` of ``spans`` (``RemoteSpanInfo`` by peer id); None when some block has no ONLINE server
    (that is ``missing_blocks``' business) or there are no blocks."""
    totals, largest, free, full = [], [], [], []
    for block in range(num_blocks):
        infos = [
            s.server_info
            for s in spans.values()
            if s.start <= block < s.end and ServerState(s.server_info.state) == ServerState.ONLINE
        ]
        if not infos:
            return None
        sizes = [i.cache_tokens_total if i.cache_tokens_total is not None else i.cache_tokens_left for i in infos]
        totals.append(sum(sizes))
        largest.append(max(sizes))
        free.append(sum(i.cache_tokens_left for i in infos))
        if not any(i.cache_tokens_left >= NEW_SESSION_TOKENS and i.sessions_left != 0 for i in infos):
            full.append(block)
    if not totals:
        return None
    return CacheRoom(min(totals), min(largest), min(free), tuple(full))


def with_quant(state: dict[str, Any], backend: Any) -> dict[str, Any]:
    """``state`` with each span row's ``quant``: the weight quantization its server announced (``none``,
    ``int8``, ``nf4``; worker/quant.py), from the spans of the swarm ``backend``'s client (no DHT read)."""
    spans = getattr(getattr(backend, "manager", None), "spans", None)
    rows = state.get("spans")
    if not isinstance(spans, Mapping) or not isinstance(rows, list):
        return state
    quant = {peer: getattr(span.server_info, "quant", "none") for peer, span in dict(spans).items()}
    return {**state, "spans": [{**row, "quant": quant.get(row.get("peer_id"), "none")} for row in rows]}


def _banned(manager: Any) -> set[str]:
    bans = getattr(manager, "bans", None)
    return set(bans.banned()) if bans is not None else set()


def backend_room(backend: Any) -> CacheRoom | None:
    """The room the swarm ``backend``'s client can use now (its routing view: no DHT read), counting only the
    servers it can route to (not banned: a banned replica's free cache is no room for a new session); None for
    a backend without a swarm (in-process) or before its first read. Where every server of some block is
    banned, the announced room (``/health`` says "unavailable" then, and routing waits or answers 503)."""
    manager, num_blocks = getattr(backend, "manager", None), getattr(backend, "num_blocks", None)
    spans = getattr(manager, "spans", None)
    if not isinstance(num_blocks, int) or not isinstance(spans, Mapping) or not spans:
        return None
    banned = _banned(manager)
    usable = {p: s for p, s in dict(spans).items() if p not in banned}
    return cache_room(usable, num_blocks) or cache_room(dict(spans), num_blocks)


def with_client_view(state: dict[str, Any], backend: Any) -> dict[str, Any]:
    """``state`` with what this gateway's client knows beyond the DHT: per server row, its ban (seconds left,
    reason), when it last answered, its recent answer time and whether it is kept while slow (``liveness``);
    ``unroutable_blocks`` (served by ONLINE servers, none usable: ``/health`` says "unavailable" with
    ``unroutable_reason``) and the watchdog's resets (``swarm_client.watchdog``)."""
    manager = getattr(backend, "manager", None)
    liveness, watchdog = getattr(manager, "liveness", None), getattr(manager, "watchdog", None)
    rows = state.get("spans")
    if liveness is None or watchdog is None or not isinstance(rows, list):
        return state
    bans = manager.bans
    out_rows = []
    for row in rows:
        peer = row.get("peer_id")
        extra: dict[str, Any] = dict(liveness.timings(peer))
        if bans.is_banned(peer):
            extra["ban"] = {"for_s": round(bans.remaining(peer), 3), "reason": bans.reason(peer)}
        out_rows.append({**row, **extra})
    blocks = watchdog.wedged()
    out = {**state, "spans": out_rows, "unroutable_blocks": blocks, "watchdog": watchdog.as_dict()}
    if blocks:
        reasons = sorted({r for p, r in bans.reasons().items() if p in dict(manager.spans)})
        out["unroutable_reason"] = (
            f"every ONLINE server of blocks {blocks[0]}..{blocks[-1]} is unusable from this gateway (banned or "
            f"not answering its ping){': ' + '; '.join(reasons[:3]) if reasons else ''}"
        )
    return out


class SwarmView:
    """``await get()``: the backend's swarm state, read on a thread of its own, single-flight, cached."""

    def __init__(self, backend: Any, max_age_s: float = STATE_MAX_AGE_S):
        self.backend = backend
        self.max_age_s = max_age_s if _takes_max_age(backend) else 0.0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME_PREFIX)
        self._inflight: asyncio.Future[dict[str, Any]] | None = None
        #: (loop time the last read began, that read's future: its state or its exception)
        self._last: tuple[float, asyncio.Future[dict[str, Any]]] | None = None
        #: reads of the backend so far (for tests and metrics)
        self.reads = 0

    async def get(self) -> dict[str, Any]:
        """The swarm state, or the exception reading it raised."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._last is not None and self.max_age_s > 0 and now - self._last[0] <= self.max_age_s / 2:
            return self._last[1].result()
        if self._inflight is None:
            inflight = loop.run_in_executor(self._executor, self._read)
            self._inflight = inflight

            def done(future: asyncio.Future[dict[str, Any]], began: float = now) -> None:
                if not future.cancelled():
                    self._last = (began, future)
                if self._inflight is future:
                    self._inflight = None

            inflight.add_done_callback(done)
        # shielded: a probe whose client hung up stops waiting, the read goes on for the others
        return await asyncio.shield(self._inflight)

    def _read(self) -> dict[str, Any]:
        self.reads += 1
        if self.max_age_s > 0:
            state = self.backend.swarm_state(max_age_s=self.max_age_s / 2)
        else:
            state = self.backend.swarm_state()
        if isinstance(state, dict):
            state = with_client_view(with_quant(state, self.backend), self.backend)
        room = backend_room(self.backend)  # the spans that read just refreshed
        if room is not None and isinstance(state, dict):
            state = {**state, "cache": room.as_dict()}
        return state

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _takes_max_age(backend: Any) -> bool:
    try:
        return "max_age_s" in inspect.signature(backend.swarm_state).parameters
    except (AttributeError, TypeError, ValueError):
        return False
