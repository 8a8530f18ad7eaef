"""When to start a batch: now, or after waiting for sessions whose next step is about to arrive.

Continuous batching alone ("run whatever queued up while the last batch computed") fragments under
load: streams come back from the client or the previous server a few milliseconds apart, the first one
starts a batch of one, the rest form the next batch, and the fragments persist. Waiting is worth it only
when it saves compute time, which depends on the hardware: on a GPU a batch of 8 costs about what a
batch of 1 does; on a CPU a batch of 2 costs twice a batch of 1 (GEMV is memory bound and the kernel for
two rows streams the weights twice) while 8 rows cost about 2× one row.

So the policy measures both things it needs instead of assuming them:

- ``BatchCosts``: how long a batch of ``m`` rows takes to compute (a running average per size; unseen
  sizes interpolated, larger ones extrapolated from the two largest seen);
- ``ArrivalPredictor``: when each open session's next step should arrive (its last arrival plus the
  running average of its step period; a session silent for several periods is not expected).

``plan_wait`` then waits for the sessions predicted within the largest wait that pays for itself:
``wait <= RECURRING_STEPS * (cost(n) + cost(k) - cost(n + k))`` (computing the ``n`` waiting rows now and
the ``k`` arriving ones after costs ``cost(n) + cost(k)``; waiting and computing them together costs
``wait + cost(n + k)``; and sessions merged once stay merged, so the saving recurs on the steps after).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

#: running averages move this far toward each new sample
EMA = 0.3
#: a session silent for this many of its own periods is idle (between turns, thinking), not expected
STALE_PERIODS = 3.0
#: sessions merged into one batch stay merged for the steps that follow (measured: fragments persist
#: for a whole generation), so a wait is weighed against the saving of this many steps, not one
RECURRING_STEPS = 4


class BatchCosts:
    """Compute seconds of a batch by its number of rows, learned from the batches actually run."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}
        self._sizes: list[int] = []

    def observe(self, rows: int, seconds: float) -> None:
        if rows not in self._seconds:
            bisect.insort(self._sizes, rows)
            self._seconds[rows] = seconds
        else:
            self._seconds[rows] += EMA * (seconds - self._seconds[rows])

    def estimate(self, rows: int) -> float | None:
        """Seconds for ``rows`` rows; None before anything was measured."""
        if not self._sizes:
            return None
        if rows in self._seconds:
            return self._seconds[rows]
        sizes, seconds = self._sizes, self._seconds
        i = bisect.bisect_left(sizes, rows)
        if i == 0:  # smaller than anything seen: proportional to the smallest
            return seconds[sizes[0]] * rows / sizes[0]
        if i < len(sizes):  # between two sizes seen: linear in between
            lo, hi = sizes[i - 1], sizes[i]
            return seconds[lo] + (seconds[hi] - seconds[lo]) * (rows - lo) / (hi - lo)
        if len(sizes) == 1:  # one size known: assume linear growth (no saving is assumed)
            return seconds[sizes[0]] * rows / sizes[0]
        lo, hi = sizes[-2], sizes[-1]
        slope = max(0.0, (seconds[hi] - seconds[lo]) / (hi - lo))
        return seconds[hi] + slope * (rows - hi)

    def saving(self, now_rows: int, later_rows: int) -> float:
        """Seconds saved by computing ``now_rows + later_rows`` together instead of one after the other."""
        a, b, both = self.estimate(now_rows), self.estimate(later_rows), self.estimate(now_rows + later_rows)
        if a is None or b is None or both is None:
            return 0.0
        return a + b - both


@dataclass
class _Arrivals:
    last: float
    rows: int
    period: float | None = None


@dataclass
class ArrivalPredictor:
    """Predicts each session's next step from the spacing of its previous ones."""

    sessions: dict[str, _Arrivals] = field(default_factory=dict)

    def arrived(self, session_id: str, rows: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        seen = self.sessions.get(session_id)
        if seen is None:
            self.sessions[session_id] = _Arrivals(now, rows)
            return
        gap = now - seen.last
        seen.period = gap if seen.period is None else seen.period + EMA * (gap - seen.period)
        seen.last, seen.rows = now, rows

    def forget(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def expected(self, exclude: set[str], now: float) -> list[tuple[float, int]]:
        """``(predicted arrival, rows)`` of the sessions due soon, earliest first, except ``exclude``."""
        due = []
        for session_id, seen in self.sessions.items():
            if session_id in exclude or seen.period is None:
                continue
            if now - seen.last > STALE_PERIODS * seen.period:
                continue
            # a late session is most likely just behind: expect it a tenth of its period from now
            due.append((max(now + 0.1 * seen.period, seen.last + seen.period), seen.rows))
        due.sort()
        return due


def plan_wait(
    costs: BatchCosts,
    expected: list[tuple[float, int]],
    pending_rows: int,
    now: float,
    max_wait: float,
    recurring: float = RECURRING_STEPS,
) -> float:
    """How long to keep the pending rows waiting for the expected ones (0: start now).

    Picks the latest predicted arrival whose wait still pays for itself (``recurring`` steps of the
    saving), so one straggler due much later does not stop the sessions due sooner from joining.
    """
    best, arriving = 0.0, 0
    for when, rows in expected:
        wait = when - now
        if wait > max_wait:
            break
        arriving += rows
        if wait <= recurring * costs.saving(pending_rows, arriving):
            best = wait
    return best
