"""A client heals itself: when every server of some block is banned while the DHT says they are ONLINE, the
client's view has gone wrong (issue 35: a gateway banned every live server for 15 minutes while a second one
beside it answered in 70 ms), so it is reset — bans, pings, answer times — and, if the p2p client's unary
reader is dead (``p2p_guard``), a new p2p client is opened. Logged as a warning with the reason each time.

``wedged_blocks`` is the pure decision; ``Watchdog.check`` runs it from the client's background refresh
(``SequenceManager._keep_fresh``) about once a second and resets after the condition held ``after`` seconds,
at most once per ``every`` seconds (servers that really died come back as bans at once, and are not worth
more than that).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from swarm_client.dht_records import RemoteSpanInfo, ServerState
from swarm_client.route_explain import format_blocks

if TYPE_CHECKING:
    from swarm_client.sequence_manager import SequenceManager

__all__ = ["Watchdog", "wedged_blocks"]

logger = logging.getLogger(__name__)


def wedged_blocks(spans: Mapping[str, RemoteSpanInfo], unusable: Collection[str], num_blocks: int) -> list[int]:
    """Blocks that some ONLINE server holds but none that is usable (``unusable``: banned, or stuck in a
    ping): no route can cross them although the DHT says they are served."""
    online: list[set[str]] = [set() for _ in range(num_blocks)]
    for peer, span in spans.items():
        if span.state == ServerState.ONLINE:
            for block in range(max(span.start, 0), min(span.end, num_blocks)):
                online[block].add(peer)
    unusable = set(unusable)
    return [b for b, peers in enumerate(online) if peers and peers <= unusable]


class Watchdog:
    def __init__(self, manager: SequenceManager, after: float = 3.0, every: float = 10.0):
        self.manager = manager
        self.after = after
        self.every = every
        self._since: float | None = None
        self._last_reset = float("-inf")
        #: resets so far, and the reason of the latest (``/v1/swarm``)
        self.resets = 0
        self.last_reason: str | None = None

    def unusable(self) -> set[str]:
        """Peers no route may use now: banned, or whose ping has been in flight past its own timeout."""
        m = self.manager
        return m.bans.banned() | m.pings.stuck(m.config.ping_timeout)

    def wedged(self) -> list[int]:
        m = self.manager
        return wedged_blocks(m.spans, self.unusable(), m.config.num_blocks)

    async def check(self, now: float | None = None) -> bool:
        """Reset the client's view if it has been wedged for ``after`` seconds; True when it did."""
        now = time.monotonic() if now is None else now
        blocks = self.wedged()
        if not blocks:
            self._since = None
            return False
        if self._since is None:
            self._since = now
        if now - self._since < self.after or now - self._last_reset < self.every:
            return False
        await self.reset(blocks, now)
        return True

    async def reset(self, blocks: list[int], now: float) -> None:
        m = self.manager
        reasons = m.bans.reasons()
        online = sum(1 for span in m.spans.values() if span.state == ServerState.ONLINE)
        dead_reader = await m.renew_p2p_if_dead()
        self.last_reason = (
            f"every ONLINE server of {format_blocks(blocks)} was unusable for {now - self._since:.1f}s "
            f"({len(reasons)} banned: {'; '.join(f'{p[-6:]}: {r}' for p, r in list(reasons.items())[:3])})"
            + ("; the p2p client's unary reader was dead: opened a new one" if dead_reader else "")
        )
        logger.warning("watchdog: resetting the client's view of %d servers: %s", online, self.last_reason)
        m.bans.clear()
        m.pings.cancel()
        m.rtt.clear()
        m.liveness.forget()
        self.resets += 1
        self._last_reset = now
        self._since = None

    def as_dict(self) -> dict:
        return {"resets": self.resets, "last_reason": self.last_reason}
