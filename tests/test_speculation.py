"""Speculative decoding's rules (gateway/speculation/verify.py): verification keeps exactly what plain decoding
would sample, the acceptance follows the rejection-sampling rule, and the planner guesses only while it pays.
The engine over a real in-process model (LocalBackend) decodes the same tokens with and without guesses."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from gateway.speculation.verify import SpeculationPlanner, StepCosts, expected_tokens, verify


def _peaked(token: int, vocab: int = 8) -> torch.Tensor:
    row = torch.full((vocab,), -10.0)
    row[token] = 10.0
    return row


def _greedy(row: torch.Tensor) -> tuple[int, None]:
    return int(torch.argmax(row)), None


def _never(token: int) -> bool:
    return False


def test_verify_keeps_guesses_while_they_equal_the_samples() -> None:
    logits = torch.stack([_peaked(t) for t in (3, 4, 5, 6)])  # what the model samples at each position
    assert [t for t, _ in verify(logits, [3, 4, 5], _greedy, _never)] == [3, 4, 5, 6]  # all kept + one more
    assert [t for t, _ in verify(logits, [3, 7, 5], _greedy, _never)] == [3, 4]  # second guess wrong
    assert [t for t, _ in verify(logits, [1, 4, 5], _greedy, _never)] == [3]  # first guess wrong
    assert [t for t, _ in verify(logits[:1], [], _greedy, _never)] == [3]  # no guess: a plain step


def test_verify_stops_at_eos() -> None:
    logits = torch.stack([_peaked(t) for t in (3, 2, 5)])
    assert [t for t, _ in verify(logits, [3, 2], _greedy, lambda t: t == 2)] == [3, 2]


def test_verify_rejects_mismatched_logits() -> None:
    with pytest.raises(ValueError, match="3 positions"):
        verify(torch.zeros(3, 8), [1], _greedy, _never)


def _chi2_p(observed: list[int], expected: list[float]) -> float:
    """p-value of Pearson's chi-square goodness-of-fit; a bin expected empty must be empty."""
    from scipy.stats import chisquare

    assert all(o == 0 for o, e in zip(observed, expected, strict=True) if e == 0)
    observed, expected = zip(*((o, e) for o, e in zip(observed, expected, strict=True) if e > 0), strict=True)
    scale = sum(observed) / sum(expected)  # float sums: make them agree exactly
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def test_accepting_a_guess_when_it_equals_the_sample_is_the_rejection_sampling_rule() -> None:
    """Over many draws with a fixed distribution p and a fixed guess d: the guess is kept with probability
    p(d) (the rule's min(1, p/q) for a point-mass guess), the token is distributed as p (the output
    distribution is unchanged), and after a rejection it is distributed as p without d, renormalised.
    Tolerance: each chi-square test must have p-value > 1e-4 (a correct rule fails one in 10^4 runs); the
    draws are seeded, so the test is deterministic."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=torch.float64)
    guess, draws = 1, 20000
    generator = torch.Generator().manual_seed(1234)

    def sample(row: torch.Tensor) -> tuple[int, None]:
        return int(torch.multinomial(torch.softmax(row, -1), 1, generator=generator)), None

    logits = torch.log(p).expand(2, -1)
    firsts, kept, after_reject = [0] * len(p), 0, [0] * len(p)
    for _ in range(draws):
        out = verify(logits, [guess], sample, _never)
        firsts[out[0][0]] += 1
        if out[0][0] == guess:
            kept += 1
            assert len(out) == 2
        else:
            after_reject[out[0][0]] += 1
            assert len(out) == 1
    assert _chi2_p(firsts, [draws * float(x) for x in p]) > 1e-4
    rate = kept / draws
    assert abs(rate - float(p[guess])) < 4 * math.sqrt(float(p[guess]) * (1 - float(p[guess])) / draws)
    residual = p.clone()
    residual[guess] = 0
    residual /= residual.sum()
    rejected = draws - kept
    assert _chi2_p(after_reject, [rejected * float(x) for x in residual]) > 1e-4


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_planner_guesses_more_when_steps_are_cheap_and_guesses_good() -> None:
    free = StepCosts()
    free.observe(1, 0.100)
    free.observe(9, 0.101)  # a slow network: eight more tokens cost 1 ms
    planner = SpeculationPlanner("prompt_lookup", free, max_draft=8)
    for _ in range(20):
        planner.observe(8, 8)
    assert planner.guesses(room=100) == 8
    assert planner.guesses(room=3) == 3  # never more than may still be emitted


def test_planner_stops_guessing_when_it_does_not_pay() -> None:
    costly = StepCosts()
    costly.observe(1, 0.010)
    costly.observe(5, 0.030)  # a CPU server: each extra token costs half a step
    planner = SpeculationPlanner("prompt_lookup", costly, max_draft=8)
    for _ in range(20):
        planner.observe(4, 0)  # nothing accepted
    assert planner.acceptance < 0.1
    assert planner.guesses(room=100) == 0
    assert planner.stats.drafted == 80 and planner.stats.accepted == 0 and planner.stats.steps == 20


def test_planner_explores_before_any_measurement() -> None:
    planner = SpeculationPlanner("prompt_lookup", StepCosts(), max_draft=8)
    assert 1 <= planner.guesses(room=100) <= 8
    with pytest.raises(ValueError):
        SpeculationPlanner("prompt_lookup", StepCosts(), max_draft=0)


def test_step_costs_learn_the_extra_token_cost() -> None:
    costs = StepCosts()
    assert costs.relative_cost(4) == pytest.approx(1 + 4 * StepCosts.PRIOR_PER_TOKEN)
    for _ in range(100):
        costs.observe(1, 0.020)
        costs.observe(5, 0.040)
    assert costs.relative_cost(4) == pytest.approx(2.0, rel=0.05)


# ------------------------------------------------------------------------------ the engine, a real model


@pytest.fixture(scope="module")
def local_backend(tiny_llama):
    from gateway.backends.local import LocalBackend

    backend = LocalBackend(tiny_llama)
    yield backend
    backend.close()


def _engine(backend, **settings):
    from gateway.decode.engine import Engine
    from gateway.settings import GatewaySettings

    return Engine(backend, GatewaySettings(model="tiny", **settings))


def _run(engine, specs):
    async def go():
        generation = await engine.start(specs)
        return await generation.collect()

    return asyncio.run(go())


def _tokens(result) -> list[int]:
    return [lp.token_id for lp in result.logprobs]


def _spec(prompt, max_tokens=40, speculation="auto", index=0, **sampling):
    from gateway.decode.choices import ChoiceSpec
    from gateway.decode.sampling import SamplingParams

    params = SamplingParams(**({"temperature": 0.0} | sampling))
    return ChoiceSpec(index, list(prompt), max_tokens, params, logprobs=2, speculation=speculation)


REPETITIVE = [5, 17, 33, 8, 91, 5, 17, 33, 8, 91, 5, 17, 33, 8, 91, 5, 17]


@pytest.mark.parametrize("max_draft", [1, 4, 16])
def test_engine_greedy_identical_with_prompt_lookup(local_backend, max_draft) -> None:
    """Guesses from the prompt and from a prediction that is wrong at every fifth token: kept ones, rejected
    ones (rolled back), several per step — and the same tokens and logprobs as plain decoding."""
    from dataclasses import replace

    engine = _engine(local_backend, max_draft_tokens=max_draft)
    plain = _run(engine, [_spec(REPETITIVE, speculation="off")])[0]
    answer = _tokens(plain)
    noisy = [t if i % 5 else (t + 1) % 1000 for i, t in enumerate(answer)]
    guessed = _run(engine, [replace(_spec(REPETITIVE, speculation="prompt_lookup"), reference_ids=noisy)])[0]
    assert plain.speculation is None
    assert guessed.text == plain.text
    assert _tokens(guessed) == answer
    for a, b in zip(guessed.logprobs, plain.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert guessed.completion_tokens == plain.completion_tokens
    stats = guessed.speculation
    assert stats is not None and stats.drafter == "prompt_lookup"
    assert stats.accepted > 0 and (max_draft == 1 or stats.accepted < stats.drafted), stats
    assert stats.steps < plain.completion_tokens - 1, "kept guesses save trips"
    engine.close()


def test_engine_copies_a_prediction_and_keeps_the_output(local_backend) -> None:
    """OpenAI's predicted outputs: the prompt-lookup drafter copies from ``reference_ids``; a prediction
    equal to the answer is accepted almost whole, and the output is the same either way."""
    from dataclasses import replace

    engine = _engine(local_backend)
    prompt = [7, 100, 23, 54, 2, 77, 12]
    plain = _run(engine, [_spec(prompt, max_tokens=30, speculation="off")])[0]
    answer = [lp.token_id for lp in plain.logprobs]
    guessed = _run(engine, [replace(_spec(prompt, max_tokens=30), reference_ids=[*prompt[-2:], *answer])])[0]
    assert [lp.token_id for lp in guessed.logprobs] == answer
    assert guessed.speculation is not None
    assert guessed.speculation.accepted >= len(answer) // 2
    engine.close()


def test_engine_stop_strings_and_several_choices_with_guesses(local_backend) -> None:
    from dataclasses import replace

    engine = _engine(local_backend)
    plain = _run(engine, [_spec(REPETITIVE, speculation="off")])[0]
    stop = plain.text[len(plain.text) // 2 : len(plain.text) // 2 + 3]
    specs = [
        replace(_spec(REPETITIVE, index=i, speculation=mode), stop=[stop])
        for i, mode in enumerate(["off", "auto", "auto"])
    ]
    results = _run(engine, specs)
    assert results[0].finish_reason == "stop"
    for r in results[1:]:
        assert (r.text, r.finish_reason, r.completion_tokens) == (results[0].text, "stop", results[0].completion_tokens)
        assert [lp.token_id for lp in r.logprobs] == [lp.token_id for lp in results[0].logprobs]
    engine.close()


SAMPLING = {"temperature": 0.9, "top_k": 4}


class _FreeSteps(StepCosts):
    """Steps cost the same whatever their length (as over a slow network): the planner guesses at every step
    where the drafter has something, so the sampling rule is exercised at (nearly) every position."""

    def observe(self, tokens: int, seconds: float) -> None:
        pass

    def relative_cost(self, k: int) -> float:
        return 1.0


def _guessing_engine(backend):
    engine = _engine(backend)
    engine.speculators.costs = _FreeSteps()
    return engine


def _with_reference(specs, reference):
    from dataclasses import replace

    return [replace(spec, reference_ids=reference) for spec in specs]


def _reference_from(results) -> list[int]:
    """Text for the drafter to copy from: what plain sampling produced (plausible guesses, often kept),
    then every token id once (so whatever was sampled, there is a guess: mostly rejected)."""
    return [t for r in results for t in _tokens(r)] + list(range(1000))


def test_engine_seeded_sampling_matches_plain_sampling(local_backend) -> None:
    """Every token comes from the same sampler call on the same logits as without guesses, so a seeded run
    gives the same tokens (up to float rounding: a longer step's logits may differ in the last bits, which
    can flip a draw that sits on a boundary — allowed for 2 seeds in 30)."""
    engine = _guessing_engine(local_backend)
    seeds = range(30)
    plain = _run(engine, [_spec(REPETITIVE, 12, "off", i, seed=s, **SAMPLING) for i, s in enumerate(seeds)])
    specs = _with_reference(
        [_spec(REPETITIVE, 12, "prompt_lookup", i, seed=s, **SAMPLING) for i, s in enumerate(seeds)],
        _reference_from(plain[::-1]),
    )
    guessed, again = _run(engine, specs), _run(engine, specs)
    same = sum(_tokens(a) == _tokens(b) for a, b in zip(plain, guessed, strict=True))
    reproduced = sum(_tokens(a) == _tokens(b) for a, b in zip(guessed, again, strict=True))
    assert same >= 28 and reproduced >= 28
    drafted = sum(r.speculation.drafted for r in guessed)
    accepted = sum(r.speculation.accepted for r in guessed)
    assert drafted > 30 * 8 and 0 < accepted < drafted, (drafted, accepted)
    engine.close()


def test_engine_sampling_frequencies_match_plain_sampling(local_backend) -> None:
    """Distinct seeds for the two arms (so the test does not lean on equal draws): at each of the first
    output positions, the token frequencies of speculative and plain sampling are the same distribution —
    a chi-square test of homogeneity, p-value > 1e-3 per position (the draws are seeded: deterministic)."""
    from scipy.stats import chi2_contingency

    engine = _guessing_engine(local_backend)
    n = 100
    plain = _run(engine, [_spec(REPETITIVE, 6, "off", i, seed=i, **SAMPLING) for i in range(n)])
    specs = [_spec(REPETITIVE, 6, "prompt_lookup", i, seed=10_000 + i, **SAMPLING) for i in range(n)]
    guessed = _run(engine, _with_reference(specs, _reference_from(plain)))
    drafted = sum(r.speculation.drafted for r in guessed)
    assert drafted > 3 * n, "guesses must be tested for the test to mean anything"
    assert sum(r.speculation.accepted for r in guessed) > n // 2
    for position in range(1, 5):
        counts: dict[int, list[int]] = {}
        for arm, results in enumerate((plain, guessed)):
            for r in results:
                tokens = _tokens(r)
                if len(tokens) > position:
                    counts.setdefault(tokens[position], [0, 0])[arm] += 1
        table = [[c[0] for c in counts.values()], [c[1] for c in counts.values()]]
        if len(counts) > 1:
            assert chi2_contingency(table).pvalue > 1e-3, (position, counts)
    engine.close()


def test_a_slow_drafter_turns_itself_off() -> None:
    """The drafter's own time counts: guesses that take longer to make than the trips they save stop."""
    costs = StepCosts()
    costs.observe(1, 0.050)
    costs.observe(9, 0.051)  # longer steps are free (a slow network)
    planner = SpeculationPlanner("draft_model", costs, max_draft=8)
    for _ in range(10):
        planner.observe(4, 2)  # half the guesses kept
    assert planner.guesses(room=100) > 0
    planner.observe_drafting(4, 4 * 0.060)  # but each guess takes more than a whole step
    assert planner.guesses(room=100) == 0


def test_a_costly_drafter_measures_a_one_token_step_first_and_again_later() -> None:
    """Where every choice guesses, nothing else measures a one-token step: a drafter whose guesses cost time
    makes one plain step when none was measured, and again after ``REFRESH_BASE_AFTER`` guessing steps."""
    costs = StepCosts()
    planner = SpeculationPlanner("draft_model", costs, max_draft=8)
    for _ in range(10):
        planner.observe(4, 4)  # every guess kept
    assert planner.guesses(room=100) > 0  # drafting's cost not known yet: guess (and learn it)
    planner.observe_drafting(4, 4 * 0.005)
    assert planner.guesses(room=100) == 0  # now a one-token step first
    costs.observe(1, 0.100)
    assert planner.guesses(room=100) == 8
    for _ in range(StepCosts.REFRESH_BASE_AFTER):
        costs.observe(9, 0.110)
    assert planner.guesses(room=100) == 0
    costs.observe(1, 0.100)
    assert planner.guesses(room=100) == 8
    free = SpeculationPlanner("prompt_lookup", StepCosts(), max_draft=8)  # free guesses: no such step
    free.observe(4, 4)
    free.observe_drafting(4, 4e-5)
    assert free.guesses(room=100) > 0


def test_plain_choices_teach_the_one_token_step_cost(local_backend) -> None:
    engine = _engine(local_backend)
    assert engine.speculators.costs.base is None
    _run(engine, [_spec(REPETITIVE, max_tokens=4, speculation="off")])
    assert engine.speculators.costs.base is not None and engine.speculators.costs.base > 0
    engine.close()
