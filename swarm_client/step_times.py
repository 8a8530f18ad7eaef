"""What this client measured of each server: an EWMA of seconds per block of its real decode steps.

A server announces its own throughput, and a hostile one can announce anything. The client times the steps
it actually sends (single-token inference steps, stateless forwards of single tokens) and routing believes
``min(claim, measured)`` (``routing.effective_throughputs``). Pure bookkeeping, no I/O; ``now`` defaults to
``time.monotonic()`` as in ``routing.BanList``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["StepTimes"]


@dataclass
class _Estimate:
    seconds_per_block: float
    steps: int
    updated: float


class StepTimes:
    """Per peer, an exponentially weighted mean of seconds per block per step.

    ``alpha`` is the weight of the newest step; an estimate not refreshed for ``ttl`` seconds is forgotten,
    so a server that was slow under a passing load is tried again some day (and re-measured at once).
    """

    def __init__(self, alpha: float = 0.3, ttl: float = 600.0):
        if not 0 < alpha <= 1 or ttl <= 0:
            raise ValueError(f"need 0 < alpha <= 1 and ttl > 0, got alpha={alpha}, ttl={ttl}")
        self.alpha = alpha
        self.ttl = ttl
        self._estimates: dict[str, _Estimate] = {}

    @staticmethod
    def _now(now: float | None) -> float:
        return time.monotonic() if now is None else now

    def record(self, peer_id: str, blocks: int, seconds: float, now: float | None = None) -> None:
        """One step of ``blocks`` blocks on ``peer_id`` took ``seconds``."""
        if blocks <= 0 or not seconds >= 0:
            return
        sample = seconds / blocks
        current = self._now(now)
        estimate = self._fresh(peer_id, current)
        if estimate is None:
            self._estimates[peer_id] = _Estimate(sample, 1, current)
            return
        estimate.seconds_per_block += self.alpha * (sample - estimate.seconds_per_block)
        estimate.steps += 1
        estimate.updated = current

    def _fresh(self, peer_id: str, now: float) -> _Estimate | None:
        estimate = self._estimates.get(peer_id)
        if estimate is not None and now - estimate.updated > self.ttl:
            del self._estimates[peer_id]
            return None
        return estimate

    def seconds_per_block(self, peer_id: str, now: float | None = None) -> float | None:
        """The current estimate for ``peer_id``, or None if unmeasured (or forgotten)."""
        estimate = self._fresh(peer_id, self._now(now))
        return None if estimate is None else estimate.seconds_per_block

    def steps(self, peer_id: str, now: float | None = None) -> int:
        """How many steps the current estimate of ``peer_id`` rests on."""
        estimate = self._fresh(peer_id, self._now(now))
        return 0 if estimate is None else estimate.steps

    def throughputs(self, now: float | None = None) -> dict[str, float]:
        """Measured tokens/s per block of every measured peer (``1 / seconds_per_block``): the unit servers
        announce, to pass to ``routing.effective_throughputs``."""
        current = self._now(now)
        speeds = {}
        for peer_id in list(self._estimates):
            estimate = self._fresh(peer_id, current)
            if estimate is not None:
                speeds[peer_id] = 1.0 / max(estimate.seconds_per_block, 1e-9)
        return speeds

    def forget(self, peer_id: str) -> None:
        self._estimates.pop(peer_id, None)
