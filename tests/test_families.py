"""Every family's blocks and head, in process, against the 🤗 model they were built from.

For each family (and the variants whose code paths differ: Falcon's older layouts and ALiBi, Falcon2's single
layernorm, Mixtral's sliding window, BLOOM's tensor-parallel-exact projections) we check stateless logits,
multi-step cached sessions through the real ``CacheManager`` + ``SpanRunner`` (where rotary and ALiBi offsets
break), greedy decoding against ``generate()``, per-block hidden states, and blocks loaded from the checkpoint
the way a worker loads them.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from swarm_client.families import Family, Head, get_family, supported_model_types
from swarm_client.tiny_model import INIT_STD, _perturb_constant_params, make_tiny_model
from swarm_client.weights import load_tensors
from worker.cache import MIN_CAPACITY, CacheManager
from worker.compute import SpanRunner
from worker.loading import load_blocks

ATOL = 1e-4
CPU = torch.device("cpu")

FAMILIES = ("llama", "mistral", "qwen2", "mixtral", "falcon", "bloom")
#: config changes on top of a family's tiny model, for code paths its default config does not take
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Falcon-7B: old layout, one KV head, attention and MLP in parallel from one layernorm
    "falcon-7b": (
        "falcon",
        {
            "new_decoder_architecture": False,
            "multi_query": True,
            "parallel_attn": True,
            "num_ln_in_parallel_attn": None,
            "num_kv_heads": 4,
        },
    ),
    # Falcon-RW: ALiBi, full multi-head attention, sequential attention → MLP, biases
    "falcon-rw": (
        "falcon",
        {
            "new_decoder_architecture": False,
            "multi_query": False,
            "parallel_attn": False,
            "alibi": True,
            "bias": True,
            "num_ln_in_parallel_attn": None,
            "num_kv_heads": 4,
        },
    ),
    # Falcon2-11B: new layout with a single layernorm feeding both branches
    "falcon2": ("falcon", {"num_ln_in_parallel_attn": 1}),
    "mixtral-window": ("mixtral", {"sliding_window": 5}),
    "bloom-tp": (
        "bloom",
        {"apply_residual_connection_post_layernorm": True, "pretraining_tp": 2, "slow_but_exact": True},
    ),
}
CASES = (*FAMILIES, *VARIANTS)


@dataclass
class Case:
    model_dir: pathlib.Path
    hf: Any  # the 🤗 CausalLM
    config: PretrainedConfig
    family: Family
    head: Head
    runner: SpanRunner

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def new_cache(self, batch: int, max_length: int = 128):
        layout = self.family.cache_layout(self.config)
        manager = CacheManager(batch * max_length, self.num_layers, layout, torch.float32)
        return manager, manager.open("session", batch, max_length)

    def step(self, manager: CacheManager, cache, ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """One cached step, as the worker's handler runs it (grow the cache, then run at its position)."""
        manager.ensure_capacity(cache, cache.position + ids.shape[1])
        return self.runner.inference_step(cache, self.head.embed(ids), cache.position, **kwargs)


def _make_variant(base: pathlib.Path, out: pathlib.Path, overrides: dict[str, Any]) -> pathlib.Path:
    config = AutoConfig.from_pretrained(base)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_constant_params(model, 0, INIT_STD)
    model.save_pretrained(out)
    return out


class _TinyModels(dict):
    """Tiny model directories by family, each written on first use (variants reuse their family's)."""

    def __init__(self, root: pathlib.Path):
        super().__init__()
        self.root = root

    def __missing__(self, family: str) -> pathlib.Path:
        self[family] = make_tiny_model(self.root / family, family=family, num_layers=4, seed=0)
        return self[family]


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory) -> _TinyModels:
    return _TinyModels(tmp_path_factory.mktemp("family-models"))


@pytest.fixture(scope="module", params=CASES)
def case(request, base_dirs, tmp_path_factory) -> Case:
    name = request.param
    if name in VARIANTS:
        base, overrides = VARIANTS[name]
        model_dir = _make_variant(base_dirs[base], tmp_path_factory.mktemp(name), overrides)
    else:
        model_dir = base_dirs[name]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = hf.config
    fam = get_family(config)
    sd = hf.state_dict()
    blocks = [
        fam.build_block(
            config,
            i,
            {
                k[len(fam.layer_prefix(i)) :]: v.clone()
                for k, v in sd.items()
                if k.startswith(fam.layer_prefix(i))
            },
        )
        for i in range(config.num_hidden_layers)
    ]
    head = fam.build_head(
        config,
        {k: v.clone() for k, v in sd.items() if any(k.startswith(p) for p in fam.head_prefixes(config))},
    )
    return Case(model_dir, hf, config, fam, head, SpanRunner(blocks, torch.float32, CPU))


def _ids(case: Case, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, case.config.vocab_size, (batch, length), generator=g)


def test_every_family_is_registered() -> None:
    assert {"llama", "mistral", "qwen2", "mixtral", "falcon", "bloom"} <= set(supported_model_types())


@torch.no_grad()
def test_stateless_logits_match(case: Case) -> None:
    ids = _ids(case, 2, 13)
    ours = case.head.final(case.runner.forward(case.head.embed(ids)))
    torch.testing.assert_close(ours, case.hf(ids).logits, atol=ATOL, rtol=0)


# the last pattern grows the cache past its first chunk mid-session and runs past the sliding window
@pytest.mark.parametrize(
    "steps", [[7, 1, 1, 3, 1], [1] * 8, [3, MIN_CAPACITY + 6]], ids=["mixed", "ones", "grow"]
)
@torch.no_grad()
def test_cached_session_matches_full_sequence(case: Case, steps: list[int]) -> None:
    ids = _ids(case, 2, sum(steps), seed=1)
    ref = case.hf(ids).logits
    manager, cache = case.new_cache(batch=2)
    start = 0
    for n in steps:
        logits = case.head.final(case.step(manager, cache, ids[:, start : start + n]))
        torch.testing.assert_close(
            logits, ref[:, start : start + n], atol=ATOL, rtol=0, msg=f"step at {start}"
        )
        start += n
    assert cache.position == ids.shape[1]


@torch.no_grad()
def test_greedy_decoding_matches_generate(case: Case) -> None:
    ids = _ids(case, 2, 5, seed=2)
    ref = case.hf.generate(ids, max_new_tokens=16, do_sample=False)
    eos = torch.tensor(case.hf.generation_config.eos_token_id)
    pad = case.hf.generation_config.pad_token_id
    manager, cache = case.new_cache(batch=2, max_length=32)
    tokens, new = ids, ids
    done = torch.zeros(2, dtype=torch.bool)
    for _ in range(16):
        next_token = case.head.final(case.step(manager, cache, new))[:, -1].argmax(-1)
        next_token = torch.where(done, pad, next_token)  # finished rows are padded, as generate() does
        done |= torch.isin(next_token, eos)
        new = next_token[:, None]
        tokens = torch.cat([tokens, new], dim=1)
        if done.all():
            break
    assert tokens.tolist() == ref.tolist()


@torch.no_grad()
def test_hidden_states_match_per_block(case: Case) -> None:
    ids = _ids(case, 2, 9, seed=3)
    ref = case.hf(ids, output_hidden_states=True).hidden_states  # embeddings, blocks 0..N-2, final norm(N-1)
    embeds = case.head.embed(ids)
    torch.testing.assert_close(embeds, ref[0], atol=ATOL, rtol=0)
    stateless = case.runner.forward(embeds, output_hidden_states=True)  # [N, B, T, H]
    manager, cache = case.new_cache(batch=2)
    first = case.step(manager, cache, ids[:, :4], output_hidden_states=True)
    rest = case.step(manager, cache, ids[:, 4:], output_hidden_states=True)
    for states in (stateless, torch.cat([first, rest], dim=2)):
        assert states.shape[0] == case.num_layers
        for i in range(case.num_layers - 1):
            torch.testing.assert_close(states[i], ref[i + 1], atol=ATOL, rtol=0, msg=f"after block {i}")
        torch.testing.assert_close(case.head.final_norm(states[-1]), ref[-1], atol=ATOL, rtol=0)


@torch.no_grad()
def test_blocks_and_head_from_checkpoint_as_servers_load_them(case: Case) -> None:
    """Checkpoint tensor names (Mixtral's per-expert ``w1/w2/w3``) and a fresh config, as workers see them."""
    config = AutoConfig.from_pretrained(case.model_dir)
    family = get_family(config)
    blocks = load_blocks(str(case.model_dir), config, family, 0, config.num_hidden_layers, torch.float32, CPU)
    head = family.build_head(
        config, load_tensors(case.model_dir, family.head_prefixes(config), dtype=torch.float32)
    )
    ids = _ids(case, 2, 11, seed=4)
    ours = head.final(SpanRunner(blocks, torch.float32, CPU).forward(head.embed(ids)))
    torch.testing.assert_close(ours, case.hf(ids).logits, atol=ATOL, rtol=0)
