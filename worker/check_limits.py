"""Who may have a reachability check now: per peer id, per caller host, and for the checker as a whole.

Peer ids are free to make, so a budget per peer id alone lets one machine with 20 Sybil ids have 20 checks
at once (the audit measured 16 dials/s at local ports, and legitimate newcomers answered ``busy``). Here a
check is admitted only if all of these allow it:

- the peer: one check at a time and one per ``per_peer_interval``;
- the caller's *host* (the IP its connection came from; all relayed callers share one host key): a token
  bucket of ``host_burst`` checks refilled one per ``host_refill`` seconds, and ``host_concurrent`` at once —
  Sybil ids on one machine share it, and one machine never takes every slot;
- the checker: ``max_concurrent`` checks at once; at most ``max_tracked`` peers and hosts remembered.

Pure bookkeeping with an injectable clock: ``admit`` says None (admitted, noted) or the refusal, ``done``
ends an admitted check.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["ALREADY_CHECKING", "BUSY", "RATE_LIMITED", "CheckLimiter"]

#: refusal codes (the ``error`` of an answer with ``reachable: None``)
RATE_LIMITED, BUSY, ALREADY_CHECKING = "rate_limited", "busy", "already_checking"


@dataclass
class CheckLimiter:
    per_peer_interval: float = 10.0
    host_burst: int = 6
    host_refill: float = 5.0
    host_concurrent: int = 2
    max_concurrent: int = 4
    max_tracked: int = 4096
    clock: Callable[[], float] = time.monotonic
    _last_check: OrderedDict[str, float] = field(default_factory=OrderedDict)  # peer → when its check began
    _buckets: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict)  # host → (tokens, when)
    _running: set[str] = field(default_factory=set)
    _host_running: Counter[str] = field(default_factory=Counter)

    def admit(self, peer: str, host: str) -> str | None:
        """None if ``peer`` (connected from ``host``) may be checked now — noted as running — else the refusal."""
        if peer in self._running:
            return f"{ALREADY_CHECKING}: one check per peer at a time"
        if len(self._running) >= self.max_concurrent:
            return f"{BUSY}: {self.max_concurrent} checks already running; ask another peer or later"
        if self._host_running[host] >= self.host_concurrent:
            return f"{BUSY}: {self.host_concurrent} checks from your address already running"
        now = self.clock()
        self._forget_old(now)
        last = self._last_check.get(peer)
        if last is not None:
            wait = self.per_peer_interval - (now - last)
            return f"{RATE_LIMITED}: one check per {self.per_peer_interval:g} s; retry in {wait:.1f} s"
        tokens = self._tokens(host, now)
        if tokens < 1.0:
            wait = (1.0 - tokens) * self.host_refill
            return f"{RATE_LIMITED}: your address used its {self.host_burst} checks; retry in {wait:.1f} s"
        if len(self._last_check) >= self.max_tracked or len(self._buckets) >= self.max_tracked:
            return f"{BUSY}: too many peers checked lately"
        self._last_check[peer] = now
        self._buckets[host] = (tokens - 1.0, now)
        self._buckets.move_to_end(host)
        self._running.add(peer)
        self._host_running[host] += 1
        return None

    def done(self, peer: str, host: str) -> None:
        """An admitted check ended (whatever its outcome)."""
        self._running.discard(peer)
        self._host_running[host] -= 1
        if self._host_running[host] <= 0:
            del self._host_running[host]

    def _tokens(self, host: str, now: float) -> float:
        tokens, when = self._buckets.get(host, (float(self.host_burst), now))
        return min(float(self.host_burst), tokens + (now - when) / self.host_refill)

    def _forget_old(self, now: float) -> None:
        """Drop peers past their interval and hosts whose bucket is full again (both dicts are in use order)."""
        while self._last_check and now - next(iter(self._last_check.values())) >= self.per_peer_interval:
            self._last_check.popitem(last=False)
        full_after = self.host_burst * self.host_refill
        while self._buckets:
            host, (tokens, when) = next(iter(self._buckets.items()))
            if tokens + (now - when) / self.host_refill < self.host_burst and now - when < full_after:
                break
            self._buckets.popitem(last=False)
