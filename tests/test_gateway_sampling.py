"""Sampling is pure torch: seeds reproduce, greedy is argmax, each filter and penalty does its one job."""

import math

import torch

from gateway.decode.sampling import Sampler, SamplingParams, choice_seed, top_logprobs


def _logits(seed: int = 0, vocab: int = 50) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * 3


def _draws(params: SamplingParams, n: int = 40) -> list[int]:
    sampler = Sampler(params, prompt_ids=[])
    return [sampler(_logits(i)) for i in range(n)]


def test_greedy_is_argmax_whatever_the_seed():
    for seed in (None, 1, 2):
        sampler = Sampler(SamplingParams(temperature=0.0, seed=seed), prompt_ids=[])
        for i in range(10):
            assert sampler(_logits(i)) == int(torch.argmax(_logits(i)))


def test_same_seed_reproduces_and_other_seeds_differ():
    a = _draws(SamplingParams(temperature=1.0, seed=123))
    b = _draws(SamplingParams(temperature=1.0, seed=123))
    c = _draws(SamplingParams(temperature=1.0, seed=124))
    assert a == b
    assert a != c


def test_filters_that_leave_one_token_are_greedy():
    for params in (
        SamplingParams(temperature=1.5, top_k=1, seed=0),
        SamplingParams(temperature=1.5, top_p=1e-6, seed=0),
        SamplingParams(temperature=1.5, top_p=0.0, seed=0),
        SamplingParams(temperature=1.5, min_p=1.0, seed=0),
    ):
        assert _draws(params, 10) == [int(torch.argmax(_logits(i))) for i in range(10)]


def test_top_k_keeps_only_the_k_most_likely():
    logits = _logits(3)
    allowed = set(torch.topk(logits, 3).indices.tolist())
    sampler = Sampler(SamplingParams(temperature=2.0, top_k=3, seed=5), prompt_ids=[])
    assert {sampler(logits) for _ in range(200)} <= allowed


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=0), prompt_ids=[])
    assert {sampler(logits) for _ in range(300)} == {0, 1}


def test_logit_bias_can_force_a_token():
    sampler = Sampler(SamplingParams(temperature=1.0, logit_bias={7: 100.0}, seed=0), prompt_ids=[])
    assert all(sampler(_logits(i)) == 7 for i in range(10))


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = Sampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1])
    assert rep.process(logits).tolist() == [1.0, -4.0, 1.0, 0.5]

    freq = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt_ids=[3])
    for t in (2, 2, 3):
        freq.observe(t)
    out = freq.process(logits).tolist()
    assert out == [2.0, -2.0, 1.0 - 2 * 0.5 - 0.25, 0.5 - 0.5 - 0.25]  # the prompt's 3 does not count


def test_top_logprobs_are_the_raw_log_softmax():
    logits = _logits(4)
    chosen, top = top_logprobs(logits, 5, 3)
    ref = torch.log_softmax(logits, dim=-1)
    assert math.isclose(chosen, float(ref[5]), rel_tol=1e-6)
    assert [i for i, _ in top] == torch.topk(ref, 3).indices.tolist()
    assert top_logprobs(logits, 5, 0)[1] == []


def test_choice_seeds_are_fixed_distinct_and_not_shifted_copies():
    assert choice_seed(None, 0) is None
    assert choice_seed(7, 1) == choice_seed(7, 1)
    seeds = {choice_seed(s, i) for s in range(20) for i in range(8)}
    assert len(seeds) == 160
    assert choice_seed(7, 1) != choice_seed(8, 0)
