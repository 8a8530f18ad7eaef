"""What a client heard from each server lately: evidence for "slow" versus "gone".

A server is gone on a closed connection, a refused or failed dial, or silence well beyond its measured pace
under the current load — never on one missed ping while it answers other sessions' steps. ``Liveness`` keeps
the evidence: when each server last answered anything (a step of any session, a ping), how long its answers
take now (an average that follows the load), and which servers the client keeps although they are slow,
because they are the only server of some block (``bans.ban_verdict``): ``/v1/swarm`` shows those timings.
Pure bookkeeping, no I/O; ``now`` defaults to ``time.monotonic()``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["PING_LATENCY_FACTOR", "Liveness", "SlowNote"]

#: a server's liveness ping may take this many times its recent answer time before it counts as missed
PING_LATENCY_FACTOR = 4.0
#: weight of the newest answer time in the running average (recent load counts most)
_ALPHA = 0.3


@dataclass
class SlowNote:
    """A server kept although it was slow: since when, how often, and the latest reason."""

    since: float
    last: float
    times: int
    reason: str


class Liveness:
    def __init__(self) -> None:
        self._heard: dict[str, float] = {}
        self._latency: dict[str, float] = {}
        self.slow: dict[str, SlowNote] = {}

    @staticmethod
    def _now(now: float | None) -> float:
        return time.monotonic() if now is None else now

    def answered(self, peer_id: str, seconds: float | None = None, now: float | None = None) -> None:
        """``peer_id`` answered (after ``seconds``, if it was a timed call): alive, and no longer slow."""
        self._heard[peer_id] = self._now(now)
        self.slow.pop(peer_id, None)
        if seconds is not None and seconds >= 0:
            old = self._latency.get(peer_id)
            self._latency[peer_id] = seconds if old is None else (1 - _ALPHA) * old + _ALPHA * seconds

    def heard_since(self, peer_id: str, since: float) -> bool:
        """Whether ``peer_id`` answered anything at or after monotonic time ``since``."""
        return self._heard.get(peer_id, float("-inf")) >= since

    def latency(self, peer_id: str) -> float | None:
        """``peer_id``'s recent answer time (seconds), or None before any timed answer."""
        return self._latency.get(peer_id)

    def allowance(self, peer_id: str, base: float) -> float:
        """How long a ping of ``peer_id`` may take: ``base``, or ``PING_LATENCY_FACTOR`` × its recent answer time
        when the load made that longer."""
        latency = self._latency.get(peer_id)
        return base if latency is None else max(base, PING_LATENCY_FACTOR * latency)

    def note_slow(self, peer_id: str, reason: str, now: float | None = None) -> SlowNote:
        """``peer_id`` was slow (a timeout) but is kept; returns its note."""
        current = self._now(now)
        note = self.slow.get(peer_id)
        if note is None:
            note = self.slow[peer_id] = SlowNote(current, current, 0, reason)
        note.last, note.times, note.reason = current, note.times + 1, reason
        return note

    def forget(self) -> None:
        """Drop the answer times and slow notes (the watchdog's reset); when each server was heard stays."""
        self._latency.clear()
        self.slow.clear()

    def timings(self, peer_id: str, now: float | None = None) -> dict:
        """``/v1/swarm``'s view of ``peer_id``: seconds since its last answer, its recent answer time, and
        the slow note if it is kept while slow."""
        current = self._now(now)
        heard = self._heard.get(peer_id)
        latency = self._latency.get(peer_id)
        out: dict = {
            "last_answer_s_ago": round(current - heard, 3) if heard is not None else None,
            "answer_time_s": round(latency, 4) if latency is not None else None,
        }
        note = self.slow.get(peer_id)
        if note is not None:
            out["slow"] = {"for_s": round(current - note.since, 3), "times": note.times, "reason": note.reason}
        return out
