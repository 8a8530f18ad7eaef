"""The event queue: callbacks ordered by simulated time (ties: the order they were scheduled)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventQueue:
    """A min-heap of ``(time, seq, callback)``; ``now`` is the simulated time of the event being run."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.processed = 0

    def at(self, when: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` at simulated time ``when`` (never before ``now``)."""
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), callback))

    def after(self, delay: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` ``delay`` simulated seconds from now."""
        self.at(self.now + max(delay, 0.0), callback)

    def run_until(self, end: float) -> None:
        """Run every event due before ``end``; ``now`` is ``end`` afterwards."""
        while self._heap and self._heap[0][0] < end:
            self.now, _, callback = heapq.heappop(self._heap)
            callback()
            self.processed += 1
        self.now = end
