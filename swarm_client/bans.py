"""Which servers a client avoids for a while, and for how long: one decision per server, not per session.

Pure bookkeeping, no I/O (``now`` defaults to ``time.monotonic()``). The rules (issue 35, "load is not
death"):

- a failure seen while the server's ban is still running is the same failure (16 sessions on a killed server
  see it within milliseconds): it neither escalates the backoff nor extends the ban — escalating once per
  session had sent one failure to the 60 s maximum at once (``1, 2, 4, … 60 s`` logged within 15 ms);
- the backoff starts from the server's measured latency when that is longer than ``base`` (a server whose
  steps take 2 s on a saturated machine is not "back" after 1 s of silence);
- an answer lifts the ban at once (``report_success``: a stream or a ping answered);
- slowness alone never bans the last server of a block (``ban_verdict``): the client waits for it instead.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from enum import Enum

__all__ = ["LATENCY_FACTOR", "BanList", "Verdict", "ban_verdict"]

#: a ban lasts at least this many times the server's measured latency (RTT or step time)
LATENCY_FACTOR = 4.0


class Verdict(Enum):
    """What a failure of a server leads to."""

    BAN = "ban"
    #: slow but the only server of some block it holds: keep it, tell the caller it is slow
    KEEP_SLOW = "keep: slow, but the only server of some of its blocks"


def ban_verdict(peer_id: str, slow: bool, holders: Mapping[int, Collection[str]], banned: Collection[str]) -> Verdict:
    """A failure of ``peer_id`` that is only slowness (``slow``: a timeout, not a closed connection, a refused
    dial or a wrong answer) bans it only where another usable server holds each of its blocks; ``holders``:
    block → the ONLINE servers holding it, ``banned``: the ones banned now."""
    if not slow:
        return Verdict.BAN
    for peers in holders.values():
        if peer_id in peers and not any(p != peer_id and p not in banned for p in peers):
            return Verdict.KEEP_SLOW
    return Verdict.BAN


class BanList:
    """Peers to avoid after a failure, with exponential backoff: the n-th failure (counted once per ban
    window) bans a peer for ``min(max(base, LATENCY_FACTOR × latency) × 2 ** (n - 1), max_ban)`` seconds.
    ``report_success`` forgets the peer's failures; ``unban`` lifts the current ban but keeps the count, so a
    peer that fails again right after is banned for longer. Each ban keeps its reason (``reasons``), for the
    ``NoRouteError`` that names who is banned and why."""

    def __init__(self, base: float = 1.0, max_ban: float = 60.0):
        if base <= 0 or max_ban < base:
            raise ValueError(f"need 0 < base <= max_ban, got base={base}, max_ban={max_ban}")
        self.base = base
        self.max_ban = max_ban
        self._failures: dict[str, int] = {}
        self._until: dict[str, float] = {}
        self._reasons: dict[str, str] = {}
        #: ban decisions taken (a repeated report within a window is not one): for tests and /v1/swarm
        self.decisions = 0

    @staticmethod
    def _now(now: float | None) -> float:
        return time.monotonic() if now is None else now

    def ban(self, peer_id: str, now: float | None = None, reason: str = "", latency: float | None = None) -> float:
        """Record a failure of ``peer_id`` (because of ``reason``) and ban it; returns the seconds it stays
        banned. Within a running ban this is the same failure: the ban stands as it was."""
        current = self._now(now)
        until = self._until.get(peer_id)
        if until is not None and current < until:
            return until - current
        if reason:
            self._reasons[peer_id] = reason
        failures = self._failures.get(peer_id, 0) + 1
        self._failures[peer_id] = failures
        base = max(self.base, LATENCY_FACTOR * latency) if latency else self.base
        duration = min(base * 2.0 ** min(failures - 1, 64), self.max_ban)
        self._until[peer_id] = current + duration
        self.decisions += 1
        return duration

    def is_banned(self, peer_id: str, now: float | None = None) -> bool:
        until = self._until.get(peer_id)
        return until is not None and self._now(now) < until

    def banned(self, now: float | None = None) -> set[str]:
        """Peers banned at ``now``; pass this to ``find_route(banned=...)``."""
        current = self._now(now)
        return {peer_id for peer_id, until in list(self._until.items()) if current < until}  # read off-loop too

    def remaining(self, peer_id: str, now: float | None = None) -> float:
        """Seconds ``peer_id`` stays banned (0 when it is not)."""
        return max(self._until.get(peer_id, 0.0) - self._now(now), 0.0)

    def reason(self, peer_id: str) -> str | None:
        """Why ``peer_id`` was last banned (kept until it succeeds again), or None."""
        return self._reasons.get(peer_id)

    def reasons(self, now: float | None = None) -> dict[str, str]:
        """The reasons of the peers banned at ``now``; pass this to ``find_route(why=...)``."""
        return {p: r for p in self.banned(now) if (r := self._reasons.get(p)) is not None}

    def unban(self, peer_id: str) -> None:
        """Lift the current ban of ``peer_id`` (its failure count, hence the next backoff, stays)."""
        self._until.pop(peer_id, None)

    def report_success(self, peer_id: str) -> None:
        """``peer_id`` answered: lift its ban and reset its backoff to ``base``."""
        self._until.pop(peer_id, None)
        self._failures.pop(peer_id, None)
        self._reasons.pop(peer_id, None)

    def clear(self) -> None:
        """Forget every ban and failure (the watchdog's reset of a client whose view went wrong)."""
        self._until.clear()
        self._failures.clear()
        self._reasons.clear()

    def failures(self, peer_id: str) -> int:
        """Failures recorded for ``peer_id`` since its last success (one per ban window)."""
        return self._failures.get(peer_id, 0)
