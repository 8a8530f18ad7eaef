"""Routes of a client's sessions (``SequenceManager.make_route``): local blocks as one hop, servers around them.

A mixin of ``SequenceManager``: it reads the swarm view, pings, bans and this client's load from there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from swarm_client.dht_records import RemoteSpanInfo
from swarm_client.errors import NoRouteError, SessionTooLongError
from swarm_client.routing import LOCAL_PEER, RouteHop, find_route

if TYPE_CHECKING:
    from swarm_client.local_span import LocalSpan
    from swarm_client.pings import Pinger

#: routing cost of each of this client's own open sessions on a server, as a share of its compute cost: a
#: gateway spreads its sessions over the servers of a span instead of piling them onto the fastest one
LOCAL_SESSION_LOAD = 0.25


class RouteMaker:
    """Needs ``route_options``, ``busy_peers`` and ``update`` (the swarm view) from ``SequenceManager``."""

    sessions_on: Counter[str]
    pings: Pinger
    local: LocalSpan | None

    def _route_now(
        self,
        spans: dict[str, RemoteSpanInfo],
        start: int,
        end: int,
        cache_tokens: int,
        avoid: Iterable[str] = (),
        adapter: str | None = None,
    ) -> list[RouteHop]:
        load = {peer: LOCAL_SESSION_LOAD * n for peer, n in self.sessions_on.items() if n > 0}
        options = self.route_options(spans, exclude=avoid, adapter=adapter)
        return find_route(
            spans, start, end, load=load, cache_tokens_needed=cache_tokens, busy=self.busy_peers(), **options
        )

    async def _route(
        self, spans: dict[str, RemoteSpanInfo], start: int, end: int, cache_tokens: int, adapter: str | None = None
    ) -> list[RouteHop]:
        """A route that leaves out peers whose ping is in flight while others can serve their blocks; where only
        they can, it waits for their pings (``ping_timeout`` at most) and routes again, through them if their
        pings are still in flight then (load is not death: a ping late on a loaded machine proves nothing)."""
        pending = self.pings.start(spans, self.bans.banned())  # also re-measures peers whose ban ran out
        try:
            return self._route_now(spans, start, end, cache_tokens, avoid=pending, adapter=adapter)
        except NoRouteError:
            if not pending:
                raise
        await self.pings.wait(pending)
        try:
            return self._route_now(spans, start, end, cache_tokens, avoid=self.pings.pending(), adapter=adapter)
        except NoRouteError:
            if not self.pings.pending():
                raise
        # a ping outlived its own timeout (a saturated machine): an unmeasured server beats no route at all
        return self._route_now(spans, start, end, cache_tokens, adapter=adapter)

    async def make_route(
        self, start: int, end: int, cache_tokens_needed: int = 0, adapter: str | None = None
    ) -> list[RouteHop]:
        """A route over ``[start, end)``: the local blocks (``local``) inside it are one hop on ``LOCAL_PEER``, and
        the blocks before and after them are routed over the servers (``_remote_route``). A session with a served
        LoRA ``adapter`` runs on servers holding it only (the local blocks do not hold served adapters)."""
        local = self.local
        if local is None or adapter is not None or local.end <= start or end <= local.start:
            return await self._remote_route(start, end, cache_tokens_needed, adapter)
        a, b = max(start, local.start), min(end, local.end)
        before = await self._remote_route(start, a, cache_tokens_needed) if start < a else []
        after = await self._remote_route(b, end, cache_tokens_needed) if b < end else []
        return [*before, RouteHop(LOCAL_PEER, a, b), *after]

    async def _remote_route(
        self, start: int, end: int, cache_tokens_needed: int = 0, adapter: str | None = None
    ) -> list[RouteHop]:
        """A route over ``[start, end)`` on servers; re-reads the DHT once before giving up with NoRouteError, or with
        ``SessionTooLongError`` when the blocks are served but no server's whole cache could hold the session."""
        for attempt in range(2):
            spans = await self.update(force=attempt > 0)
            try:
                return await self._route(spans, start, end, cache_tokens_needed, adapter)
            except NoRouteError:
                if attempt == 0:
                    continue
                # NoRouteError here: the blocks are unserved whatever the session's length
                self._route_now(spans, start, end, 0, avoid=self.pings.pending(), adapter=adapter)
                largest = max((s.server_info.cache_tokens_total or 0 for s in spans.values()), default=0)
                raise SessionTooLongError(
                    f"no server of blocks {start}:{end} can hold a session of {cache_tokens_needed} tokens "
                    f"(the largest cache budget announced is {largest}); ask for fewer tokens",
                    details={"cache_tokens_total": largest},
                ) from None
        raise AssertionError("unreachable")
