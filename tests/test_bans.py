"""Ban decisions (``swarm_client.bans``): one per server per backoff window, from its latency, lifted by an
answer, never for slowness on the last server of a block."""

from __future__ import annotations

import pytest

from swarm_client.bans import LATENCY_FACTOR, BanList, Verdict, ban_verdict


def test_first_failure_lasts_base():
    bans = BanList()
    assert bans.ban("A", now=100.0) == 1.0
    assert bans.is_banned("A", now=100.99)
    assert not bans.is_banned("A", now=101.0)
    assert not bans.is_banned("B", now=100.0)


def test_sixteen_sessions_seeing_one_failure_make_one_ban_step():
    """The audit: one kill seen by 16 sessions logged 1, 2, 4 … 60 s within 15 ms."""
    bans = BanList(base=1.0, max_ban=60.0)
    durations = [bans.ban("A", now=0.0 + i * 0.001) for i in range(16)]
    assert durations[0] == 1.0 and all(d <= 1.0 for d in durations)
    assert bans.failures("A") == 1 and bans.decisions == 1
    assert not bans.is_banned("A", now=1.0)  # not extended by the later reports either


def test_failures_in_successive_windows_escalate_up_to_max():
    bans = BanList(base=1.0, max_ban=60.0)
    now, durations = 0.0, []
    for _ in range(9):
        durations.append(bans.ban("A", now=now))
        now += durations[-1]  # the next failure comes once the ban ran out
    assert durations == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert bans.failures("A") == 9


def test_backoff_starts_from_the_measured_latency():
    bans = BanList(base=1.0, max_ban=60.0)
    assert bans.ban("slow", now=0.0, latency=2.0) == LATENCY_FACTOR * 2.0
    assert bans.ban("fast", now=0.0, latency=0.002) == 1.0  # never below base
    assert BanList(base=1.0, max_ban=5.0).ban("slow", now=0.0, latency=10.0) == 5.0


def test_an_answer_lifts_the_ban_and_resets_the_backoff():
    bans = BanList()
    for now in (0.0, 1.0, 3.0):
        bans.ban("A", now=now)
    assert bans.is_banned("A", now=3.5)
    bans.report_success("A")
    assert not bans.is_banned("A", now=3.5) and bans.failures("A") == 0
    assert bans.ban("A", now=3.5) == 1.0


def test_unban_lifts_the_ban_but_keeps_the_backoff():
    bans = BanList()
    bans.ban("A", now=0.0)
    bans.unban("A")
    assert not bans.is_banned("A", now=0.0)
    assert bans.ban("A", now=0.0) == 2.0


def test_reasons_kept_until_a_success_and_clear_forgets_everything():
    bans = BanList(base=1.0, max_ban=8.0)
    bans.ban("A", now=0.0, reason="refused")
    bans.ban("B", now=0.0)
    assert bans.reasons(now=0.5) == {"A": "refused"}
    assert bans.reasons(now=5.0) == {}
    assert bans.reason("A") == "refused"
    assert bans.remaining("A", now=0.25) == 0.75 and bans.remaining("C", now=0.0) == 0.0
    bans.clear()
    assert bans.banned(now=0.0) == set() and bans.failures("A") == 0 and bans.reason("A") is None


def test_uses_the_monotonic_clock_by_default(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("swarm_client.bans.time.monotonic", lambda: clock[0])
    bans = BanList()
    bans.ban("A")
    assert bans.banned() == {"A"}
    clock[0] += 1.0
    assert not bans.is_banned("A")


@pytest.mark.parametrize("base,max_ban", [(0.0, 60.0), (-1.0, 60.0), (10.0, 5.0)])
def test_rejects_bad_config(base, max_ban):
    with pytest.raises(ValueError):
        BanList(base=base, max_ban=max_ban)


# --- the verdict ---------------------------------------------------------------------------------------------

HOLDERS = {0: ["A"], 1: ["A", "B"], 2: ["B", "C"]}


def test_the_only_server_of_a_block_is_not_banned_for_slowness():
    assert ban_verdict("A", slow=True, holders=HOLDERS, banned=()) is Verdict.KEEP_SLOW


def test_the_only_server_is_banned_on_evidence_of_death():
    assert ban_verdict("A", slow=False, holders=HOLDERS, banned=()) is Verdict.BAN


def test_a_slow_server_with_a_usable_replica_is_banned():
    assert ban_verdict("B", slow=True, holders=HOLDERS, banned=()) is Verdict.BAN


def test_a_replica_that_is_banned_itself_does_not_count():
    assert ban_verdict("B", slow=True, holders=HOLDERS, banned={"C"}) is Verdict.KEEP_SLOW
