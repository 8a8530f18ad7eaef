"""Sliding-window attention in the llama path (Mistral, Qwen2), in process, against 🤗 past the window.

With a window of 4 and 13+ tokens, most queries lose keys to the window, so a block that ignored it (or
applied it to the wrong Qwen2 layers) would be far off. Each case runs stateless logits, a cached multi-step
session through the real ``CacheManager`` + ``SpanRunner``, and greedy decoding; one check proves the window
matters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from swarm_client.families import Head, get_family
from swarm_client.families.llama import sliding_window
from swarm_client.tiny_model import INIT_STD, _perturb_constant_params, family_config
from worker.cache import CacheManager
from worker.compute import SpanRunner

ATOL = 1e-4
WINDOW = 4
LAYERS = 4

#: case → (model type, config overrides, the window 🤗 applies per layer)
CASES: dict[str, tuple[str, dict[str, Any], list[int | None]]] = {
    "mistral": ("mistral", {"sliding_window": WINDOW}, [WINDOW] * LAYERS),
    # Qwen2: only layers >= max_window_layers slide, and only with use_sliding_window
    "qwen2": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2},
        [None, None, WINDOW, WINDOW],
    ),
    "qwen2-window-off": (
        "qwen2",
        {"use_sliding_window": False, "sliding_window": WINDOW, "max_window_layers": 2},
        [None] * LAYERS,
    ),
}


@dataclass
class Model:
    hf: Any
    config: PretrainedConfig
    head: Head
    runner: SpanRunner


def _config(model_type: str, overrides: dict[str, Any]) -> PretrainedConfig:
    """A tiny config built as a loaded checkpoint's is (so Qwen2 derives its layer types itself)."""
    base = family_config(model_type, vocab_size=96, hidden_size=32, num_layers=LAYERS, eos=[1], pad=0)
    base = base.to_dict()
    base.pop("layer_types", None)
    base.update(overrides)
    return AutoConfig.for_model(**base)


@pytest.fixture(scope="module", params=list(CASES))
def model(request) -> tuple[Model, list[int | None]]:
    model_type, overrides, windows = CASES[request.param]
    config = _config(model_type, overrides)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _perturb_constant_params(hf, 0, INIT_STD)
    family = get_family(config)
    sd = hf.state_dict()
    blocks = []
    for i in range(LAYERS):
        prefix = family.layer_prefix(i)
        tensors = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
        blocks.append(family.build_block(config, i, tensors))
    head_tensors = {k: v for k, v in sd.items() if k.startswith(tuple(family.head_prefixes(config)))}
    head = family.build_head(config, head_tensors)
    return Model(hf, config, head, SpanRunner(blocks, torch.float32, torch.device("cpu"))), windows


def _ids(config: PretrainedConfig, batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, config.vocab_size, (batch, length), generator=g)


def test_window_per_layer_is_where_hf_puts_it(model) -> None:
    m, windows = model
    assert [sliding_window(m.config, i) for i in range(LAYERS)] == windows
    assert [b.sliding_window for b in m.runner.blocks] == windows


@torch.no_grad()
def test_stateless_logits_match_past_the_window(model) -> None:
    m, _ = model
    ids = _ids(m.config, 2, 4 * WINDOW, seed=0)
    ours = m.head.final(m.runner.forward(m.head.embed(ids)))
    torch.testing.assert_close(ours, m.hf(ids).logits, atol=ATOL, rtol=0)


@torch.no_grad()
def test_cached_steps_match_past_the_window(model) -> None:
    m, _ = model
    ids = _ids(m.config, 2, 15, seed=1)
    ref = m.hf(ids).logits
    layout = get_family(m.config).cache_layout(m.config)
    manager = CacheManager(2 * 32, LAYERS, layout, torch.float32)
    cache = manager.open("s", 2, 32)
    start = 0
    for n in (6, 1, 1, 5, 1, 1):  # a prefill longer than the window, then steps crossing it
        manager.ensure_capacity(cache, start + n)
        out = m.runner.inference_step(cache, m.head.embed(ids[:, start : start + n]), start)
        torch.testing.assert_close(m.head.final(out), ref[:, start : start + n], atol=ATOL, rtol=0)
        start += n


@torch.no_grad()
def test_greedy_matches_generate(model) -> None:
    m, _ = model
    ids = _ids(m.config, 1, 3, seed=2)
    ref = m.hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens = ids
    for _ in range(12):  # full recomputation: the stateless path, past the window
        logits = m.head.final(m.runner.forward(m.head.embed(tokens)))
        tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    assert tokens.tolist() == ref.tolist()


@torch.no_grad()
def test_the_window_changes_the_result(model) -> None:
    """Guard against a vacuous pass: without the window the outputs differ (where 🤗 applies one)."""
    m, windows = model
    if not any(windows):
        pytest.skip("no sliding layers in this config")
    ids = _ids(m.config, 1, 4 * WINDOW, seed=3)
    saved = [b.sliding_window for b in m.runner.blocks]
    try:
        for b in m.runner.blocks:
            b.sliding_window = None
        full = m.head.final(m.runner.forward(m.head.embed(ids)))
    finally:
        for b, w in zip(m.runner.blocks, saved, strict=True):
            b.sliding_window = w
    assert (full - m.hf(ids).logits).abs().max() > 10 * ATOL
