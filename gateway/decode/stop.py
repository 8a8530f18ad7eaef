"""Stop strings, matched on decoded text across token boundaries: pure functions and a small stateful matcher.

A stop string is never part of the output. Text that might be the start of a stop string is held back until
the next tokens show whether it is (then it is dropped with everything after it) or not (then it is released).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopMatcher", "find_stop", "partial_stop_len"]


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class StopMatcher:
    """Feed text deltas in, get back the part that is safe to emit.

    Invariant: no stop string can begin inside text already emitted, because any suffix that could begin one
    is held back — so the first match found is the first match in the whole output.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add ``text``; return what can be emitted now. Sets ``stopped`` when a stop string completed."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        idx = find_stop(buf, self.stops)
        if idx is not None:
            self._held = ""
            self.stopped = True
            return buf[:idx]
        keep = partial_stop_len(buf, self.stops)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The generation ended without a stop: release what was held back."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
