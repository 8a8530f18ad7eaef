"""Drafters (gateway/speculation/drafting.py) against plain references: prompt lookup against a brute-force search over
the whole context, draft models against greedy decoding of the 🤗 model run without a cache, for the four
families the swarm serves, whole and truncated to their first blocks."""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from gateway.speculation.drafting import Drafter, DraftModel, ModelDrafter, PromptLookupDrafter
from swarm_client.tiny_model import make_tiny_model

FAMILIES = ("llama", "mixtral", "falcon", "bloom")

# ------------------------------------------------------------------------------------------ prompt lookup


def brute_lookup(context: list[int], reference: list[int], k: int, max_ngram: int = 4, min_ngram: int = 1):
    """The definition, searched the slow way: longest suffix first; within one length the most recent earlier
    occurrence in the context, else the first in the reference; what followed it, up to k tokens."""
    if k <= 0:
        return []
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > len(context):
            continue
        suffix = context[-n:]
        for end in range(len(context) - 1, n - 1, -1):
            if context[end - n : end] == suffix:
                return context[end : end + k]
        for end in range(n, len(reference)):
            if reference[end - n : end] == suffix:
                return reference[end : end + k]
    return []


def test_repeated_ngram_proposes_what_followed() -> None:
    assert PromptLookupDrafter().propose([1, 2, 3, 4, 9, 9, 1, 2, 3], 2) == [4, 9]


def test_longest_ngram_wins_over_a_more_recent_shorter_one() -> None:
    # "5 7" occurred once (then 1); "7" alone occurred more recently (then 2)
    assert PromptLookupDrafter().propose([5, 7, 1, 6, 7, 2, 5, 7], 3) == [1, 6, 7]
    assert PromptLookupDrafter(max_ngram=1).propose([5, 7, 1, 6, 7, 2, 5, 7], 3) == [2, 5, 7]


def test_most_recent_occurrence_wins() -> None:
    assert PromptLookupDrafter(max_ngram=2).propose([1, 2, 3, 1, 2, 4, 1, 2], 3) == [4, 1, 2]


def test_reference_ids() -> None:
    assert PromptLookupDrafter(reference_ids=[7, 10, 11, 12, 13]).propose([10, 11], 5) == [12, 13]
    # at one n-gram length the context comes first ...
    assert PromptLookupDrafter(reference_ids=[10, 11, 12]).propose([10, 11, 5, 10, 11], 3) == [5, 10, 11]
    # ... but a longer match in the reference beats a shorter one in the context
    assert PromptLookupDrafter(reference_ids=[1, 2, 3, 4, 8]).propose([3, 4, 9, 2, 3, 4], 3) == [8]
    # the reference's last n-gram has nothing after it: no match
    assert PromptLookupDrafter(reference_ids=[1, 2]).propose([2], 3) == []


def test_k_beyond_the_known_continuation_returns_what_exists() -> None:
    assert PromptLookupDrafter().propose([1, 2, 1], 10) == [2, 1]


def test_nothing_to_propose() -> None:
    drafter = PromptLookupDrafter()
    assert drafter.propose([1, 2, 3], 4) == []
    assert drafter.propose([], 4) == []
    assert PromptLookupDrafter().propose([1, 2, 1], 0) == []
    with pytest.raises(ValueError):
        PromptLookupDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError):
        PromptLookupDrafter(min_ngram=0)


def test_incremental_equals_rebuilt_and_brute_force() -> None:
    rng = random.Random(0)
    reference = [rng.randrange(12) for _ in range(60)]
    incremental = PromptLookupDrafter(reference_ids=reference, max_ngram=3)
    context: list[int] = []
    rebuilds = 0
    for step in range(300):
        if step % 50 == 49:  # not an extension: cut back and change a token
            context = context[: rng.randrange(len(context))] + [100 + step]
            rebuilds += 1
        else:
            context = context + [rng.randrange(12) for _ in range(rng.randrange(4))]
        k = rng.randrange(1, 6)
        expected = brute_lookup(context, reference, k, max_ngram=3)
        assert incremental.propose(context, k) == expected, step
        assert PromptLookupDrafter(reference_ids=reference, max_ngram=3).propose(context, k) == expected
    assert incremental.rebuilds == rebuilds


def test_long_context_indexes_each_token_once() -> None:
    rng = random.Random(1)
    stream = [rng.randrange(2000) for _ in range(200_000)]
    stream[-50:] = stream[1000:1050]  # a copied passage at the end
    drafter = PromptLookupDrafter()
    context = stream[:20_000]  # within MAX_INDEXED_TOKENS: all of it indexed
    drafter.propose(context, 8)
    calls = 0
    while len(context) < len(stream):  # decode-like growth: a few tokens per call, into the same list
        context.extend(stream[len(context) : len(context) + 1 + calls % 4])
        drafter.propose(context, 8)
        calls += 1
    assert calls > 10_000
    assert drafter.propose(context, 8) == stream[1050:1058]
    # every end position indexed once per n-gram size, however many calls it took
    assert drafter.positions_indexed == sum(len(stream) - n for n in range(1, 5))
    assert drafter.rebuilds == 0
    drafter.propose(stream[:-8], 8)  # shorter: not an extension
    assert drafter.rebuilds == 1


def test_a_long_prompt_indexes_only_its_last_tokens() -> None:
    """A 100k-token first context indexes its last MAX_INDEXED_TOKENS only (bounded memory and first-call
    time); a passage copied from inside that window is still found, one from before it is not."""
    from gateway.speculation.drafting import MAX_INDEXED_TOKENS

    rng = random.Random(2)
    stream = [rng.randrange(50_000) for _ in range(100_000)]
    recent = len(stream) - MAX_INDEXED_TOKENS // 2
    drafter = PromptLookupDrafter()
    assert drafter.propose([*stream, *stream[recent : recent + 4]], 3) == stream[recent + 4 : recent + 7]
    assert drafter.positions_indexed <= 4 * (MAX_INDEXED_TOKENS + 4)
    old = PromptLookupDrafter()
    assert old.propose([*stream, *stream[1000:1004]], 3) != stream[1004:1007]  # (a shorter match may exist)


def test_drafters_follow_the_protocol() -> None:
    assert isinstance(PromptLookupDrafter(), Drafter)
    assert PromptLookupDrafter.name == "prompt_lookup"
    assert ModelDrafter.name == "draft_model"


# ---------------------------------------------------------------------------------------------- draft model


@pytest.fixture(scope="module")
def model_dirs(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("draft-models")
    dirs = {"llama": tiny_llama}
    for family in FAMILIES[1:]:
        dirs[family] = str(make_tiny_model(root / family, family=family, num_layers=4, seed=0))
    return dirs


@pytest.fixture(scope="module")
def hf_models(model_dirs) -> dict[str, torch.nn.Module]:
    return {f: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for f, p in model_dirs.items()}


def truncated_reference(full: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A 🤗 model built with ``num_hidden_layers=layers``, holding ``full``'s weights."""
    config = copy.deepcopy(full.config)
    config.num_hidden_layers = layers
    small = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    weights = full.state_dict()
    small.load_state_dict({key: weights[key] for key in small.state_dict()}, strict=True)
    return small


@torch.inference_mode()
def greedy(model: torch.nn.Module, context: list[int], k: int) -> list[int]:
    """k argmax tokens, each from a full forward over everything so far (no cache)."""
    ids = list(context)
    for _ in range(k):
        ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(context) :]


def random_context(vocab: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


@pytest.mark.parametrize("family", FAMILIES)
def test_draft_model_is_greedy_decoding(family, model_dirs, hf_models, caplog) -> None:
    reference = hf_models[family]
    with caplog.at_level(logging.WARNING, logger="gateway.speculation.drafting"):
        draft = DraftModel.load(model_dirs[family])
    assert not caplog.records  # no missing or unexpected weights
    assert draft.num_layers == 4
    drafter = draft.drafter()
    assert isinstance(drafter, Drafter)
    vocab = reference.config.vocab_size
    context = random_context(vocab, 12, seed=1)
    drafts = drafter.propose(context, 5)
    assert drafts == greedy(reference, context, 5)
    assert drafter.propose(context, 5) == drafts  # same context, same drafts (the cache rewinds)

    # the head accepted two drafts and sampled its own next token: the cache of the accepted ones is reused
    context = context + drafts[:2] + [(drafts[2] + 1) % vocab]
    assert drafter.propose(context, 4) == greedy(reference, context, 4)
    assert drafter.cached_tokens == len(context) + 3

    # a context that is no extension: cropped to the common prefix, same answer as a fresh drafter
    diverged = context[:7] + random_context(vocab, 6, seed=2)
    expected = greedy(reference, diverged, 4)
    assert drafter.propose(diverged, 4) == expected
    assert draft.drafter().propose(diverged, 4) == expected
    drafter.close()
    assert drafter.cached_tokens == 0
    with pytest.raises(RuntimeError):
        drafter.propose(diverged, 4)


@pytest.mark.parametrize("family", FAMILIES)
def test_truncated_draft_model_is_the_first_blocks(family, model_dirs, hf_models, caplog) -> None:
    full = hf_models[family]
    with caplog.at_level(logging.WARNING, logger="gateway.speculation.drafting"):
        draft = DraftModel.load(model_dirs[family], layers=2)
    assert not caplog.records  # the only weights left out are those of blocks 2 and 3
    small = truncated_reference(full, 2)
    assert draft.num_layers == 2
    assert draft.model.state_dict().keys() == small.state_dict().keys()
    assert sum(p.numel() for p in draft.model.parameters()) == sum(p.numel() for p in small.parameters())
    for key, value in small.state_dict().items():
        assert torch.equal(draft.model.state_dict()[key], value), key

    vocab = full.config.vocab_size
    drafter = draft.drafter()
    context = random_context(vocab, 10, seed=3)
    drafts = drafter.propose(context, 5)
    assert drafts == greedy(small, context, 5)
    context = context + drafts[:3] + random_context(vocab, 2, seed=4)
    assert drafter.propose(context, 3) == greedy(small, context, 3)


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_quantized_draft_model_drafts_with_its_dequantized_weights(quant, model_dirs, hf_models, caplog) -> None:
    """``quant``: every projection of the draft's blocks runs on the workers' quantized kernel, and its drafts
    are greedy decoding of the 🤗 model holding the dequantized weights."""
    from swarm_client.kernels.quantized import Int8Linear, NF4Linear

    with caplog.at_level(logging.WARNING, logger="gateway.speculation.drafting"):
        draft = DraftModel.load(model_dirs["llama"], quant=quant)
    assert not caplog.records
    kind = {"int8": Int8Linear, "nf4": NF4Linear}[quant]
    projections = [m for m in draft.model.modules() if isinstance(m, kind)]
    assert len(projections) == 4 * 7 + 1  # q, k, v, o, gate, up, down of each of the 4 blocks, and the head
    assert not any(type(m) is torch.nn.Linear for m in draft.model.modules())
    assert type(draft.model.get_input_embeddings()) is torch.nn.Embedding  # a tied head's copy is quantized

    reference = copy.deepcopy(hf_models["llama"])
    quantized = {name: m for name, m in draft.model.named_modules() if isinstance(m, kind)}
    head = quantized.pop("lm_head")
    reference.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=False)  # untied from embeddings
    with torch.no_grad():
        reference.lm_head.weight.copy_(head.weight)
        for name, module in reference.named_modules():
            if name in quantized:
                module.weight.copy_(quantized[name].weight)
    context = random_context(reference.config.vocab_size, 12, seed=7)
    with torch.inference_mode():
        ids = torch.tensor([context])
        assert torch.allclose(draft.model(ids).logits, reference(ids).logits, atol=1e-4)
    assert draft.drafter().propose(context, 5) == greedy(reference, context, 5)


def test_draft_quantization_limits(model_dirs, caplog) -> None:
    with pytest.raises(ValueError, match="CPU drafts only"):
        DraftModel.load(model_dirs["llama"], device="cuda", quant="int8")
    # BLOOM's projections have other names
    with caplog.at_level(logging.WARNING, logger="gateway.speculation.drafting"):
        DraftModel.load(model_dirs["bloom"], quant="int8")
    assert any("only its head is int8" in r.getMessage() for r in caplog.records)


def test_bad_layer_counts(model_dirs) -> None:
    for layers in (0, -1, 5):
        with pytest.raises(ValueError, match="between 1 and the model's 4 layers"):
            DraftModel.load(model_dirs["llama"], layers=layers)
    assert DraftModel.load(model_dirs["llama"], layers=4).num_layers == 4


def test_long_context_prefills_in_chunks(model_dirs, hf_models) -> None:
    reference = hf_models["llama"]
    drafter = DraftModel.load(model_dirs["llama"]).drafter()
    context = random_context(reference.config.vocab_size, 1100, seed=5)
    assert drafter.propose(context, 3) == greedy(reference, context, 3)


def test_drafts_stop_at_the_context_window(model_dirs) -> None:
    draft = DraftModel.load(model_dirs["llama"], layers=1)
    window = draft.max_positions
    assert window is not None
    drafter = draft.drafter()
    assert len(drafter.propose([5] * (window - 2), 8)) == 2
    assert drafter.propose([5] * window, 8) == []


def test_sliding_window_cache_past_its_window(hf_models, tmp_path) -> None:
    """A sliding-window layer cannot crop once past its window: the drafter re-prefills, same drafts."""
    windowed = copy.deepcopy(hf_models["mixtral"])
    windowed.config.sliding_window = 5
    windowed.save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    drafter = DraftModel.load(str(tmp_path)).drafter()
    context = random_context(reference.config.vocab_size, 9, seed=6)
    drafts = drafter.propose(context, 4)
    assert drafts == greedy(reference, context, 4)
    context = context + drafts[:1] + [(drafts[1] + 1) % reference.config.vocab_size]
    assert drafter.propose(context, 4) == greedy(reference, context, 4)


def test_priming_runs_the_context_ahead_and_changes_no_draft(tiny_llama) -> None:
    """``propose(context, 0)`` (the engine's priming, beside the prefill) runs all but the context's last
    token through the draft model; the drafts that follow are the unprimed drafter's."""
    draft = DraftModel.load(tiny_llama)
    context = list(range(3, 40))
    primed, fresh = draft.drafter(), draft.drafter()
    assert primed.propose(context, 0) == []
    assert primed.cached_tokens == len(context) - 1
    assert primed.propose(context, 5) == fresh.propose(context, 5)
