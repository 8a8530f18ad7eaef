"""Which blocks a server should hold: pure numpy over the spans announced on the DHT (Petals-style).

A new server takes the window where the swarm is weakest; a running server periodically asks
``should_choose_other_blocks`` whether moving its span would lift the swarm's weakest block enough to be
worth reloading weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from swarm_client.dht_records import RemoteSpanInfo, ServerState

__all__ = ["block_throughputs", "choose_best_blocks", "should_choose_other_blocks"]

_ACTIVE_STATES = (ServerState.JOINING, ServerState.ONLINE)
_EPS = 1e-6


def _active(spans: Mapping[str, RemoteSpanInfo]) -> dict[str, RemoteSpanInfo]:
    return {peer_id: span for peer_id, span in spans.items() if span.state in _ACTIVE_STATES}


def block_throughputs(spans: Mapping[str, RemoteSpanInfo], num_blocks: int) -> np.ndarray:
    """Per-block sum of the announced throughput of JOINING/ONLINE servers; shape ``[num_blocks]``.

    Spans reaching past ``num_blocks`` are clipped.
    """
    throughputs = np.zeros(num_blocks, dtype=np.float64)
    for span in _active(spans).values():
        lo, hi = max(span.start, 0), min(span.end, num_blocks)
        if lo < hi:
            throughputs[lo:hi] += span.server_info.throughput
    return throughputs


def _best_start(throughputs: np.ndarray, length: int) -> int:
    """Start of the ``length``-block window whose weakest block is weakest (ties: least total, then start)."""
    windows = np.lib.stride_tricks.sliding_window_view(throughputs, length)  # [num_windows, length]
    keys = zip(windows.min(axis=1).tolist(), windows.sum(axis=1).tolist(), range(len(windows)), strict=True)
    return min(keys)[2]


def choose_best_blocks(
    num_served: int, spans: Mapping[str, RemoteSpanInfo], num_blocks: int
) -> tuple[int, int]:
    """The span ``(start, end)`` of ``num_served`` blocks a joining server should load.

    Picks the contiguous window whose weakest block has the least throughput (ties: least total
    throughput, then lowest start). A server able to hold more than ``num_blocks`` gets the whole model.
    """
    if num_served <= 0 or num_blocks <= 0:
        raise ValueError(f"need num_served > 0 and num_blocks > 0, got {num_served}, {num_blocks}")
    length = min(num_served, num_blocks)
    start = _best_start(block_throughputs(spans, num_blocks), length)
    return start, start + length


def should_choose_other_blocks(
    my_peer_id: str,
    spans: Mapping[str, RemoteSpanInfo],
    num_blocks: int,
    *,
    balance_quality: float = 0.75,
) -> bool:
    """Whether this server should reload at another span.

    Simulates taking my span out and placing it again with ``choose_best_blocks``; True only if that
    moves it and the swarm's minimum per-block throughput grows so much that
    ``current_min < balance_quality * new_min``. A move that still leaves some block uncovered (e.g. I am
    the only server and cannot hold every block) is never worth it. False if my span is not announced
    (or not JOINING/ONLINE): there is nothing to move yet.
    """
    active = _active(spans)
    mine = active.get(my_peer_id)
    if mine is None:
        return False
    lo, hi = max(mine.start, 0), min(mine.end, num_blocks)
    if lo >= hi:
        return True  # my span lies outside the model: any real place is better
    current = block_throughputs(active, num_blocks)
    others = block_throughputs({p: s for p, s in active.items() if p != my_peer_id}, num_blocks)
    length = hi - lo
    new_start = _best_start(others, length)
    if new_start == lo:
        return False  # already where a fresh server would go
    moved = others.copy()
    moved[new_start : new_start + length] += mine.server_info.throughput
    current_min, new_min = float(current.min()), float(moved.min())
    if new_min < _EPS:
        return False  # moving would still leave a gap
    return current_min < balance_quality * new_min
