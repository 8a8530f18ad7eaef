"""Who gets a full server's cache: per-holder shares, which idle sessions to reclaim, and when idle is too long.

The audit's squat: one peer id opened 300 streams of ``max_length`` 64 with one step each and sat idle — the
cache read ``cache_tokens_free 0`` and every gateway user got 503 for as long as it sent a token per idle
timeout; the per-peer session cap (1024) never bit. The rules here:

- a *holder* is who the tokens count against: the caller's observed IP (Sybil ids on one machine are one
  holder), or its peer id when it is seen on loopback or through a relay (``holder_of``);
- each holder's *share* is ``peer_share`` of the cache. A holder may use more while the cache has room — one
  gateway serving many users is one peer id — but what it holds beyond its share is reclaimable;
- when the cache is full and a holder within its share needs room, the sessions of the holder furthest over
  its share are evicted, not-stepping ones idle longest first (``choose_victims``); the evicted stream's next
  step gets ``SessionEvictedError`` and its client re-opens elsewhere. Detached sessions go before any of this;
- under memory pressure (less than ``pressure_free`` of the cache free) an idle stream is closed after
  ``pressure_idle_timeout`` instead of the configured idle timeout (``idle_limit``);
- kept (detached) sessions go when room is needed in ``keep_order``: those never resumed first (a chat UI's
  one-off title, tags and follow-up requests, or a conversation not continued yet), least recently used first;
  sessions resumed at least once (live conversations) only after all of them, least recently used first.
  Plain LRU evicted a conversation's cache for the background requests a chat UI sends after each reply
  (issue 40).

Pure functions: the cache manager (worker/cache.py) feeds them its sessions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from worker.dial_policy import IPAddress

__all__ = ["Holding", "choose_victims", "holder_of", "idle_limit", "keep_order"]


@dataclass(frozen=True)
class Holding:
    """One session as the policy sees it."""

    session_id: str
    holder: str
    slots: int
    idle_for: float
    #: in a step now (its lock held): never evicted
    stepping: bool = False


def holder_of(peer: str, observed: Sequence[IPAddress]) -> str:
    """Whom a peer's tokens count against: ``ip:<addr>`` for a direct non-loopback connection, else
    ``peer:<id>`` (a loopback caller is a process of this machine's operator; a relayed one has no address)."""
    direct = [ip for ip in observed if not ip.is_loopback]
    return f"ip:{direct[0]}" if direct else f"peer:{peer}"


def choose_victims(
    sessions: Iterable[Holding], holder: str, asking: int, needed: int, share: int, min_idle: float
) -> list[str]:
    """Sessions to evict so ``holder``, asking for ``asking`` more slots of which ``needed`` are not free, gets
    them — or [] if it may not (it would pass its ``share``) or eviction cannot free enough.
    Victims come from the holder furthest over its share, one at a
    time (most idle first, never one stepping or idle under ``min_idle``), only while that holder stays over."""
    sessions = list(sessions)
    held: Counter[str] = Counter()
    for s in sessions:
        held[s.holder] += s.slots
    if held[holder] + asking > share:
        return []
    candidates: dict[str, list[Holding]] = {}
    for s in sorted(sessions, key=lambda s: -s.idle_for):
        if s.holder != holder and not s.stepping and s.idle_for >= min_idle:
            candidates.setdefault(s.holder, []).append(s)
    victims: list[str] = []
    freed = 0
    while freed < needed:
        over = [h for h in candidates if candidates[h] and held[h] > share]
        if not over:
            return []
        biggest = max(over, key=lambda h: held[h])
        victim = candidates[biggest].pop(0)
        victims.append(victim.session_id)
        held[biggest] -= victim.slots
        freed += victim.slots
    return victims


def idle_limit(idle_timeout: float, pressure_idle_timeout: float, free: int, total: int, pressure_free: float) -> float:
    """How long a stream may sit idle now: ``idle_timeout``, or the shorter ``pressure_idle_timeout`` while
    less than ``pressure_free`` of the cache is free."""
    if total > 0 and free < pressure_free * total:
        return min(idle_timeout, pressure_idle_timeout)
    return idle_timeout


def keep_order(resumes: int, last_used: float) -> tuple[bool, float]:
    """Sort key of kept (detached) sessions, first evicted first: never-resumed before resumed, then least
    recently used (``last_used``: monotonic seconds). A session resumed once has proved it is a conversation;
    one never resumed may be a one-off that nobody will continue."""
    return resumes > 0, last_used
