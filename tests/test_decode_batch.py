"""``StepGatherer``: the decode steps of concurrent choices go to the backend as one call, each caller gets
its own result or exception, and a batch waits only (and briefly) for choices that are still decoding."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from gateway.decode import batch as decode_batch
from gateway.decode.batch import StepGatherer


class Recorder:
    """``run_batch`` that records each batch and squares the items (a negative item fails on its own)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.threads: set[str] = set()

    def __call__(self, items, deliver):
        self.batches.append(list(items))
        self.threads.add(threading.current_thread().name)
        return [ValueError(f"bad {i}") if i < 0 else i * i for i in items]


@pytest.fixture
def executor():
    with ThreadPoolExecutor(2, thread_name_prefix="batch") as pool:
        yield pool


def test_items_submitted_together_run_as_one_call_with_their_own_results(executor):
    run = Recorder()
    gatherer = StepGatherer(executor, run)

    async def main():
        futures = [gatherer.submit(key, item) for key, item in enumerate([2, 3, -1, 4])]
        return await asyncio.gather(*futures, return_exceptions=True)

    results = asyncio.run(main())
    assert run.batches == [[2, 3, -1, 4]] and run.threads and all(t.startswith("batch") for t in run.threads)
    assert results[:2] == [4, 9] and results[3] == 16
    assert isinstance(results[2], ValueError) and "bad -1" in str(results[2])
    assert (gatherer.batches, gatherer.items) == (1, 4)


def test_a_failing_batch_fails_each_of_its_callers(executor):
    def broken(items, deliver):
        raise RuntimeError("backend down")

    gatherer = StepGatherer(executor, broken)

    async def main():
        futures = [gatherer.submit(key, key) for key in range(3)]
        return await asyncio.gather(*futures, return_exceptions=True)

    assert all(isinstance(r, RuntimeError) and "backend down" in str(r) for r in asyncio.run(main()))


def test_a_batch_waits_for_choices_still_decoding_but_not_for_finished_ones(executor):
    """Three choices decode in lock-step; each emits its token for a different time before its next step.
    The next batch waits for all three; once one finishes (forget), nobody waits for it."""
    run = Recorder()
    gatherer = StepGatherer(executor, run)
    delays = {0: 0.0, 1: 0.001, 2: 0.002}  # well under GATHER_SECONDS

    async def choice(key: int, steps: int) -> None:
        for step in range(steps):
            await gatherer.submit(key, 10 * key + step)
            await asyncio.sleep(delays[key])  # emitting the text of the token
        gatherer.forget(key)

    async def main():
        await asyncio.gather(choice(0, 3), choice(1, 3), choice(2, 1))

    started = time.monotonic()
    asyncio.run(main())
    assert run.batches[0] == [0, 10, 20]  # all three, submitted in one iteration
    assert run.batches[1:] == [[1, 11], [2, 12]]  # choice 2 finished: waited for until it said so, no longer
    assert time.monotonic() - started < 1.0


def test_a_choice_that_does_not_come_back_delays_the_others_at_most_briefly(executor, monkeypatch):
    monkeypatch.setattr(decode_batch, "GATHER_SECONDS", 0.05)
    run = Recorder()
    gatherer = StepGatherer(executor, run)

    async def main():
        await asyncio.gather(gatherer.submit("a", 1), gatherer.submit("b", 2))
        # "b" is expected back but never submits nor finishes (a stalled reader): "a" goes alone, late
        t0 = time.monotonic()
        await gatherer.submit("a", 3)
        return time.monotonic() - t0

    waited = asyncio.run(main())
    assert run.batches == [[1, 2], [3]]
    assert 0.04 <= waited < 1.0


def test_groups_never_share_a_batch_and_do_not_wait_for_each_other(executor, monkeypatch):
    """Two pipeline groups: each batch holds one group's items, and a group whose member is expected back
    does not hold up the other group (which goes on at once, batch after batch)."""
    monkeypatch.setattr(decode_batch, "GATHER_SECONDS", 0.5)
    run = Recorder()
    gatherer = StepGatherer(executor, run)

    async def main():
        await asyncio.gather(*(gatherer.submit(key, key, group=key % 2) for key in range(4)))
        # group 1 (keys 1, 3) is expected back and stays away; group 0 goes on without waiting for it
        t0 = time.monotonic()
        for step in range(3):
            await asyncio.gather(gatherer.submit(0, 10 + step, group=0), gatherer.submit(2, 20 + step, group=0))
        return time.monotonic() - t0

    waited = asyncio.run(main())
    assert sorted(map(sorted, run.batches[:2])) == [[0, 2], [1, 3]]
    assert run.batches[2:] == [[10, 20], [11, 21], [12, 22]]
    assert waited < 0.4  # less than one wait for group 1's expected keys


def test_a_key_that_moves_group_is_not_waited_for_in_its_old_one(executor, monkeypatch):
    """A session replaced after a failure may land in another group: its old group stops expecting it."""
    monkeypatch.setattr(decode_batch, "GATHER_SECONDS", 0.5)
    run = Recorder()
    gatherer = StepGatherer(executor, run)

    async def main():
        await asyncio.gather(gatherer.submit("a", 1, group=0), gatherer.submit("b", 2, group=0))
        await gatherer.submit("b", 3, group=1)  # "b" moved to group 1
        t0 = time.monotonic()
        await gatherer.submit("a", 4, group=0)
        return time.monotonic() - t0

    waited = asyncio.run(main())
    assert run.batches == [[1, 2], [3], [4]]
    assert waited < 0.4


def test_results_delivered_early_do_not_wait_for_a_late_item_of_their_batch(executor, monkeypatch):
    """A batch whose item "slow" is late (a frozen server): ``run_batch`` delivers the others early; their
    callers go on and step again (next batches) while "slow" is still running, and "slow" gets its own
    result when it comes. Nothing is answered twice."""
    monkeypatch.setattr(decode_batch, "GATHER_SECONDS", 0.5)
    release = threading.Event()
    batches: list[list[str]] = []

    def run(items, deliver):
        batches.append(list(items))
        if "slow" in items:
            deliver([(i, f"{x}!") for i, x in enumerate(items) if x != "slow"])
            assert release.wait(5)
        return [f"{x}!" for x in items]

    gatherer = StepGatherer(executor, run)  # two threads: the late batch holds one

    async def main():
        late = gatherer.submit("s", "slow")
        first = await asyncio.gather(gatherer.submit("a", "a1"), gatherer.submit("b", "b1"))
        assert not late.done()
        t0 = time.monotonic()
        later = [await asyncio.gather(gatherer.submit("a", f"a{n}"), gatherer.submit("b", f"b{n}")) for n in (2, 3)]
        waited = time.monotonic() - t0
        release.set()
        return first, later, await late, waited

    first, later, late, waited = asyncio.run(main())
    assert first == ["a1!", "b1!"] and later == [["a2!", "b2!"], ["a3!", "b3!"]] and late == "slow!"
    assert batches == [["slow", "a1", "b1"], ["a2", "b2"], ["a3", "b3"]]
    assert waited < 0.4  # "s" was not expected back while its step was still running


def test_run_steps_hands_over_the_prompt_steps_together_and_a_late_one_after():
    """``run_steps`` (the swarm backend's ``step_many``): steps that answer together are one group, a late
    one (here 1 s) its own; a batch with no late step is only returned (one hand-off, as before)."""
    from gateway.backends.swarm_steps import run_steps

    def step(delay: float, value: int):
        async def go() -> int:
            await asyncio.sleep(delay)
            if value < 0:
                raise ValueError("bad step")
            return value

        return go

    groups: list[list[tuple[int, object]]] = []
    finish = lambda i, out: out if isinstance(out, BaseException) else out * 10  # noqa: E731
    steps = {0: step(0.01, 1), 1: step(1.0, 2), 2: step(0.01, -1), 3: step(0.02, 4)}
    t0 = time.monotonic()
    results = run_steps(
        steps, finish, lambda pairs: groups.append((time.monotonic() - t0, sorted(pairs, key=lambda p: p[0])))
    )
    assert results[0] == 10 and results[1] == 20 and results[3] == 40 and isinstance(results[2], ValueError)
    assert len(groups) == 1  # the late step's result is only returned
    at, first = groups[0]
    assert [i for i, _ in first] == [0, 2, 3] and at < 0.9
    groups.clear()
    assert run_steps({0: step(0.0, 1), 1: step(0.01, 2)}, finish, groups.append) == {0: 10, 1: 20}
    assert groups == []
