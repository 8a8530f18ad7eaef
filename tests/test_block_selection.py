"""Unit tests for worker.block_selection: per-block throughput, span choice, rebalancing."""

from __future__ import annotations

import numpy as np
import pytest

from swarm_client.dht_records import RemoteSpanInfo, ServerInfo, ServerState
from worker.block_selection import block_throughputs, choose_best_blocks, should_choose_other_blocks


def span(
    peer_id: str, start: int, end: int, throughput: float = 10.0, state: ServerState = ServerState.ONLINE
) -> RemoteSpanInfo:
    info = ServerInfo(state=state, start_block=start, end_block=end, throughput=throughput)
    return RemoteSpanInfo(peer_id, start, end, info)


def swarm(*spans: RemoteSpanInfo) -> dict[str, RemoteSpanInfo]:
    return {s.peer_id: s for s in spans}


# --- block_throughputs ------------------------------------------------------------------------------


def test_block_throughputs_sums_joining_and_online_only():
    spans = swarm(
        span("A", 0, 3, 10),
        span("B", 2, 5, 5, ServerState.JOINING),
        span("C", 0, 5, 100, ServerState.OFFLINE),
    )
    np.testing.assert_allclose(block_throughputs(spans, 6), [10, 10, 15, 5, 5, 0])


def test_block_throughputs_empty_swarm_and_clipping():
    np.testing.assert_array_equal(block_throughputs({}, 3), np.zeros(3))
    np.testing.assert_allclose(block_throughputs(swarm(span("A", 2, 9, 1)), 4), [0, 0, 1, 1])


# --- choose_best_blocks -----------------------------------------------------------------------------


def test_first_server_takes_the_start():
    assert choose_best_blocks(4, {}, 10) == (0, 4)


def test_picks_the_gap():
    spans = swarm(span("A", 0, 4), span("B", 6, 10))
    assert choose_best_blocks(2, spans, 10) == (4, 6)


def test_picks_gap_at_the_end():
    assert choose_best_blocks(3, swarm(span("A", 0, 7)), 10) == (7, 10)


def test_window_larger_than_gap_covers_the_gap():
    spans = swarm(span("A", 0, 5, 10), span("B", 6, 10, 20))
    start, end = choose_best_blocks(3, spans, 10)
    assert start <= 5 < end
    assert (start, end) == (3, 6)  # among windows holding block 5, least total throughput


def test_picks_the_weakest_region():
    spans = swarm(span("A", 0, 5, 50), span("B", 5, 10, 5))
    assert choose_best_blocks(5, spans, 10) == (5, 10)


def test_weakest_block_beats_lower_total():
    # Per block: 100, 1, 100, 2, 2, 2. Window [3,6) has the least total (6) but its weakest block (2)
    # is stronger than block 1; of the two windows holding block 1, [1,4) has the lesser total.
    spans = swarm(span("A", 0, 1, 100), span("B", 1, 2, 1), span("C", 2, 3, 100), span("D", 3, 6, 2))
    assert choose_best_blocks(3, spans, 6) == (1, 4)


def test_tie_on_weakest_broken_by_total():
    spans = swarm(span("A", 0, 2, 10), span("B", 2, 4, 20), span("C", 4, 6, 10), span("D", 6, 8, 15))
    assert choose_best_blocks(4, spans, 8) == (4, 8)


def test_full_tie_broken_by_lowest_start():
    spans = swarm(span("A", 0, 8, 10))
    assert choose_best_blocks(3, spans, 8) == (0, 3)


def test_offline_servers_do_not_count():
    spans = swarm(span("A", 0, 4, 10), span("B", 4, 8, 10, ServerState.OFFLINE))
    assert choose_best_blocks(4, spans, 8) == (4, 8)


def test_server_larger_than_model_takes_everything():
    assert choose_best_blocks(50, swarm(span("A", 0, 4)), 8) == (0, 8)


@pytest.mark.parametrize("num_served,num_blocks", [(0, 8), (-1, 8), (2, 0)])
def test_choose_rejects_bad_sizes(num_served, num_blocks):
    with pytest.raises(ValueError):
        choose_best_blocks(num_served, {}, num_blocks)


# --- should_choose_other_blocks ---------------------------------------------------------------------


def test_rebalance_when_duplicating_while_a_gap_exists():
    # me and A both hold [0,5); blocks [5,10) are held only by a weak server.
    spans = swarm(span("me", 0, 5, 10), span("A", 0, 5, 10), span("B", 5, 10, 1))
    assert should_choose_other_blocks("me", spans, 10)


def test_rebalance_into_uncovered_gap_when_others_still_cover_my_blocks():
    spans = swarm(span("me", 0, 5, 10), span("A", 0, 5, 10))
    assert should_choose_other_blocks("me", spans, 10)


def test_no_rebalance_when_balanced():
    spans = swarm(span("me", 0, 5, 10), span("A", 5, 10, 10))
    assert not should_choose_other_blocks("me", spans, 10)


def test_no_rebalance_for_small_gain():
    # Moving me (10) onto B's region lifts the min from 10 to 12 only: 10 >= 0.75 * 12.
    spans = swarm(span("me", 0, 5, 10), span("A", 0, 5, 12), span("B", 5, 10, 10))
    assert not should_choose_other_blocks("me", spans, 10)


def test_balance_quality_threshold():
    # Per block now: 25 on [0,5), 10 on [5,10): min 10. Moving me to [5,10) gives 15 | 20: min 15.
    spans = swarm(span("me", 0, 5, 10), span("A", 0, 5, 15), span("B", 5, 10, 10))
    assert should_choose_other_blocks("me", spans, 10, balance_quality=0.75)  # 10 < 11.25
    assert not should_choose_other_blocks("me", spans, 10, balance_quality=0.6)  # 10 >= 9


def test_already_in_best_place():
    spans = swarm(span("A", 0, 5, 10), span("me", 5, 10, 10), span("B", 0, 10, 5))
    assert not should_choose_other_blocks("me", spans, 10)


def test_only_server_with_partial_span_does_not_move():
    # Moving [0,5) to [5,10) would just swap which half is missing.
    assert not should_choose_other_blocks("me", swarm(span("me", 0, 5, 10)), 10)


def test_only_server_holding_everything_does_not_move():
    assert not should_choose_other_blocks("me", swarm(span("me", 0, 10, 10)), 10)


def test_move_that_still_leaves_a_gap_is_refused():
    # Two gaps ([3,5) and [8,10)); I can only fill one by moving and would open another.
    spans = swarm(span("me", 0, 3, 10), span("A", 5, 8, 10))
    assert not should_choose_other_blocks("me", spans, 10)


def test_unknown_or_offline_me_does_not_move():
    spans = swarm(span("A", 0, 5, 10), span("me", 0, 5, 10, ServerState.OFFLINE))
    assert not should_choose_other_blocks("me", spans, 10)
    assert not should_choose_other_blocks("ghost", spans, 10)


def test_joining_me_counts():
    spans = swarm(span("me", 0, 5, 10, ServerState.JOINING), span("A", 0, 5, 10), span("B", 5, 10, 1))
    assert should_choose_other_blocks("me", spans, 10)


def test_span_outside_model_moves():
    assert should_choose_other_blocks("me", swarm(span("me", 12, 14, 10), span("A", 0, 10, 10)), 10)


def test_rebalance_decision_is_pure():
    spans = swarm(span("me", 0, 5, 10), span("A", 0, 5, 10), span("B", 5, 10, 1))
    before = dict(spans)
    should_choose_other_blocks("me", spans, 10)
    assert spans == before
    assert [s.start for s in spans.values()] == [0, 0, 5]
