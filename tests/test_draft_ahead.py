"""Drafting the next guesses while a step travels (gateway/speculation/draft_ahead.py): used only when the step kept
every guess and yielded the drafter's own next one, never touching the drafter from two threads, and the engine's
output unchanged."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from gateway.speculation.draft_ahead import LookAhead

TEXT = list(range(100, 160))  # what the served model "says"; the drafter below knows it


class ScriptDrafter:
    """Proposes what follows the context in ``TEXT`` (or nothing), one caller at a time (asserted)."""

    name = "draft_model"

    def __init__(self, gate: threading.Event | None = None):
        self.gate = gate
        self.calls: list[tuple[int, int]] = []
        self.busy = threading.Lock()
        self.closed = False

    def propose(self, context, k):
        assert self.busy.acquire(blocking=False), "the drafter was used from two threads at once"
        try:
            if self.gate is not None:
                assert self.gate.wait(10)
            self.calls.append((len(context), k))
            n = len(context)
            return TEXT[n : n + k] if list(context) == TEXT[:n] else []
        finally:
            self.busy.release()

    def close(self):
        self.closed = True


def travel(ahead: LookAhead) -> None:
    """The step's trip: long enough for the draft in flight to end (else ``take`` may cancel it unstarted)."""
    assert ahead._future is not None
    ahead._future.result(10)


def test_guesses_drafted_ahead_are_used_when_the_step_kept_every_guess_and_the_next_one() -> None:
    drafter = ScriptDrafter()
    with ThreadPoolExecutor(1) as pool:
        ahead = LookAhead(drafter, pool)
        context = TEXT[:10]
        ahead.start(context, TEXT[10:14], 4)  # a step feeding 4 guesses is on the wire
        travel(ahead)
        # it kept all 4 and sampled TEXT[14], the drafter's own next guess: TEXT[15:19] are ready
        assert ahead.take(TEXT[:15], 4) == TEXT[15:19]
        assert drafter.calls == [(14, 5)] and ahead.hits == 1
        assert ahead.take(TEXT[:15], 4) is None  # used once

        ahead.start(TEXT[:15], TEXT[15:19], 3)
        travel(ahead)
        assert ahead.take([*TEXT[:17], 999], 3) is None  # two kept, then another token: not what was assumed
        ahead.start(TEXT[:15], TEXT[15:19], 3)
        travel(ahead)
        assert ahead.take(TEXT[:19], 3) is None  # all kept but no next token yet (a stop): nothing assumed
        ahead.start(TEXT[:15], TEXT[15:19], 6)
        travel(ahead)
        assert ahead.take(TEXT[:20], 2) == TEXT[20:22]  # at most k of what was drafted
        assert ahead.misses == 2 and ahead.hits == 2


def test_a_draft_not_started_is_cancelled_and_a_running_one_awaited() -> None:
    gate = threading.Event()
    slow = ScriptDrafter(gate)
    with ThreadPoolExecutor(1) as pool:
        blocker = pool.submit(gate.wait, 10)  # the one thread is busy
        ahead = LookAhead(slow, pool)
        ahead.start(TEXT[:10], TEXT[10:12], 2)
        assert ahead.take(TEXT[:13], 2) is None and slow.calls == []  # cancelled before it ran
        gate.set()
        blocker.result(10)
        ahead.start(TEXT[:10], TEXT[10:12], 2)
        assert ahead.take(TEXT[:13], 2) in (TEXT[13:15], None)  # awaited if it ran (None: cancelled first)


def test_close_waits_for_the_running_draft_without_blocking() -> None:
    gate = threading.Event()
    drafter = ScriptDrafter(gate)
    with ThreadPoolExecutor(1) as pool:
        ahead = LookAhead(drafter, pool)
        ahead.start(TEXT[:10], TEXT[10:12], 2)
        while not drafter.busy.locked():  # running (inside propose, held at the gate)
            threading.Event().wait(0.01)
        ahead.close(drafter.close)
        assert not drafter.closed  # returned at once; the drafter closes when the running draft ends
        gate.set()
    assert drafter.closed


TRIP_S = 0.05  # what a step's trip along the chain takes, beyond the compute (the swarm's network)


@pytest.fixture(scope="module")
def far_backend(tiny_llama):
    """The local 🤗 model behind a ``TRIP_S`` trip per step: long next to the draft's own forward."""
    from gateway.backends.local import LocalBackend, LocalSession

    class FarSession(LocalSession):
        def step(self, token_ids, all_logits=False):
            time.sleep(TRIP_S)
            return super().step(token_ids, all_logits)

    class FarBackend(LocalBackend):
        def open_session(self, max_length, session_id=None):
            session = super().open_session(max_length, session_id)
            session.__class__ = FarSession
            return session

    backend = FarBackend(tiny_llama)
    yield backend
    backend.close()


def test_engine_with_a_draft_model_drafts_ahead_and_keeps_the_output(far_backend, tiny_llama) -> None:
    """The served model as its own draft (every guess right): most steps' guesses were drafted while the step
    before travelled, and the tokens and logprobs are plain decoding's."""
    import asyncio

    from gateway.decode.choices import ChoiceSpec
    from gateway.decode.engine import Engine
    from gateway.decode.sampling import SamplingParams
    from gateway.settings import GatewaySettings

    engine = Engine(far_backend, GatewaySettings(model="tiny", draft_model=tiny_llama, max_draft_tokens=4))
    greedy = SamplingParams(temperature=0.0)
    prompt = [864, 394, 776, 911, 430, 41, 265]  # 40 tokens without an end-of-text from this model

    async def run(mode: str):
        generation = await engine.start([ChoiceSpec(0, prompt, 40, greedy, logprobs=1, speculation=mode)])
        return (await generation.collect())[0]

    try:
        plain, guessed = asyncio.run(run("off")), asyncio.run(run("draft_model"))
        assert [lp.token_id for lp in guessed.logprobs] == [lp.token_id for lp in plain.logprobs]
        for a, b in zip(guessed.logprobs, plain.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        stats = guessed.speculation
        assert stats is not None and stats.accepted == stats.drafted > 0, stats
        assert stats.steps >= 4 and stats.drafted_ahead >= stats.steps // 2, stats
    finally:
        engine.close()
