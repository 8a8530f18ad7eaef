"""Tiny replicas of real checkpoints (``swarmserve tiny-model OUT --like NAME``).

Fast tests: every replica keeps its real model's facts — stated here a second time, independently of
``swarm_client.model_likes`` — with small sizes, and is byte-deterministic for a seed.

Slow tests, one ``swarmserve up`` (default flags: 2 workers, default ``--cache-tokens``) per replica, shared by
its checks: the distributed model over that swarm against the local 🤗 replica (logits within 1e-4 in fp32,
identical greedy tokens), then a 3-turn streamed chat with the openai SDK whose every turn is the local greedy
text and whose turns 2–3 reuse the KV cache. ``UP_DEFAULT`` replicas run by default; ``SWARMSERVE_ALL_LIKES=1``
runs all of them.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from swarm_client.model_likes import LIKES, like_config, like_names, make_like_model
from swarm_client.tiny_model import main as tiny_main
from tests.gateway_fixtures import chat_prompt_ids, collect_stream, greedy_reference

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
QWEN_YARN = {
    "rope_type": "yarn",
    "type": "yarn",
    "rope_theta": 1e6,
    "factor": 4.0,
    "original_max_position_embeddings": 32768,
}
# name: (context window, rope parameters or None for ALiBi, heads per KV head, tied head, q/k/v bias, norm eps,
#        (experts, top-k) or None, sliding window or None)
FACTS: dict[str, tuple[int, dict | None, int, bool, bool, float, tuple[int, int] | None, int | None]] = {
    "llama-3.1-405b": (131072, LLAMA3_ROPE, 16, False, False, 1e-5, None, None),
    "llama-3.1-8b": (131072, LLAMA3_ROPE, 4, False, False, 1e-5, None, None),
    "mixtral-8x22b": (65536, {"rope_type": "default", "rope_theta": 1e6}, 6, False, False, 1e-5, (8, 2), None),
    "falcon-40b": (2048, {"rope_type": "default", "rope_theta": 10000.0}, 16, True, False, 1e-5, None, None),
    "bloom-176b": (2048, None, 1, True, True, 1e-5, None, None),
    "qwen2.5-72b": (32768, {"rope_type": "default", "rope_theta": 1e6}, 8, False, True, 1e-6, None, None),
    "qwen2.5-72b-yarn": (131072, QWEN_YARN, 8, False, True, 1e-6, None, None),
    "mistral-7b": (32768, {"rope_type": "default", "rope_theta": 1e6}, 4, False, False, 1e-5, None, None),
}
UP_DEFAULT = ("llama-3.1-405b", "mixtral-8x22b", "bloom-176b")
LAYERS = 4


def test_every_like_is_covered() -> None:
    assert set(like_names()) == set(FACTS)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("likes")
    return {name: make_like_model(root / name, name, num_layers=LAYERS, seed=0) for name in FACTS}


def _heads(config: Any) -> tuple[int, int]:
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None) or heads
    return heads, kv


@pytest.mark.parametrize("name", list(FACTS))
def test_replica_keeps_the_real_facts_and_shrinks_sizes(replicas: dict[str, Path], name: str) -> None:
    context, rope, ratio, tied, qkv_bias, eps, moe, window = FACTS[name]
    path = replicas[name]
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    like = LIKES[name]
    assert config.model_type == like.config["model_type"]
    # the context window: the config's, and the tokenizer's model_max_length (gateway limits)
    assert tokenizer.model_max_length == context
    if config.model_type == "bloom":
        assert not hasattr(config, "max_position_embeddings")  # BLOOM's config.json has none (ALiBi)
    elif name == "qwen2.5-72b-yarn":
        assert config.max_position_embeddings == 32768  # as Qwen's card leaves it; YaRN ×4 reaches 131072
    else:
        assert config.max_position_embeddings == context
    if rope is None:
        assert config.model_type == "bloom"  # ALiBi, no rotary at all
    else:
        assert config.rope_parameters == rope
    if config.model_type == "falcon":
        assert config.new_decoder_architecture and config.parallel_attn and not config.alibi and not config.bias
        assert config.num_ln_in_parallel_attn in (None, 2)
    heads, kv = _heads(config)
    assert heads // kv == ratio and heads % kv == 0
    assert kv >= 2 or ratio == 1 and kv == heads  # GQA models keep more than one KV head
    assert config.tie_word_embeddings is tied
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) is tied
    assert (getattr(config, "rms_norm_eps", None) or config.layer_norm_epsilon) == eps
    biases = [n for n, _ in model.named_parameters() if n.endswith("bias") and re.search(r"(q_proj|query)", n)]
    assert bool(biases) is qkv_bias
    if moe is None:
        assert not hasattr(config, "num_local_experts")
    else:
        assert (config.num_local_experts, config.num_experts_per_tok) == moe
    assert getattr(config, "sliding_window", None) == window
    if config.model_type == "qwen2":
        assert config.use_sliding_window is False
        assert set(config.layer_types) == {"full_attention"}
    # generation: no BOS (the tiny tokenizer has none); a list of EOS ids stays a list
    assert config.bos_token_id is None
    assert isinstance(model.generation_config.eos_token_id, list) is like.eos_is_list
    # sizes are small
    assert config.num_hidden_layers == LAYERS
    assert config.vocab_size == len(tokenizer)
    assert config.hidden_size <= 256
    assert sum(p.numel() for p in model.parameters()) < 4_000_000


def test_llama3_rope_hits_every_band_at_tiny_head_dim(replicas: dict[str, Path]) -> None:
    """head_dim 8 with the real original_max_position_embeddings 8192: frequencies kept, smoothed and scaled."""
    config = AutoConfig.from_pretrained(replicas["llama-3.1-405b"])
    head_dim = config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * torch.pi / inv_freq
    assert (wavelen < 8192 / 4).any() and (wavelen > 8192).any()
    assert ((wavelen >= 8192 / 4) & (wavelen <= 8192)).any()


@pytest.mark.parametrize("name", list(FACTS))
def test_family_blocks_match_local_replica(replicas: dict[str, Path], name: str) -> None:
    """Our block and head code (what workers and clients run) over a KV cache: a 9-token prefill then 4 decode
    steps give 🤗's logits within 1e-4 — every replica, in-process (the swarm tests below add the wire)."""
    from safetensors.torch import load_file

    from swarm_client.families import get_family

    path = replicas[name]
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = local.config
    family = get_family(config)
    tensors = load_file(str(path / "model.safetensors"))
    head_prefixes = tuple(family.head_prefixes(config))
    head = family.build_head(config, {k: v for k, v in tensors.items() if k.startswith(head_prefixes)})
    layout = family.cache_layout(config)
    blocks, caches = [], []
    for i in range(config.num_hidden_layers):
        prefix = family.layer_prefix(i)
        own = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        blocks.append(family.build_block(config, i, own))
        caches.append(tuple(torch.zeros(1, layout.num_kv_heads, 16, layout.head_dim) for _ in range(2)))
    ids = torch.randint(0, config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = local(ids).logits
        got, position = [], 0
        for chunk in (ids[:, :9], ids[:, 9:10], ids[:, 10:11], ids[:, 11:12], ids[:, 12:13]):
            hidden = head.embed(chunk)
            for block, kv in zip(blocks, caches, strict=True):
                hidden = block(hidden, position, kv)
            got.append(head.final(hidden))
            position += chunk.shape[1]
    torch.testing.assert_close(torch.cat(got, dim=1), expected, atol=1e-4, rtol=0)


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("name", ["llama-3.1-405b", "mixtral-8x22b", "bloom-176b", "falcon-40b"])
def test_replica_bytes_are_deterministic_for_a_seed(replicas: dict[str, Path], tmp_path: Path, name: str) -> None:
    again = make_like_model(tmp_path / "again", name, num_layers=LAYERS, seed=0)
    other = make_like_model(tmp_path / "other", name, num_layers=LAYERS, seed=1)
    assert _digest(again) == _digest(replicas[name])
    assert (again / "config.json").read_text() == (replicas[name] / "config.json").read_text()
    assert _digest(other) != _digest(again)


def test_cli_like_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tiny_main([str(tmp_path / "m"), "--like", "mistral-7b", "--layers", "2"]) == 0
    assert '"family": "mistral-7b"' in capsys.readouterr().out
    assert AutoConfig.from_pretrained(tmp_path / "m").max_position_embeddings == 32768
    like = ["--like", "mistral-7b"]
    for bad in (["--like", "gpt-5"], [*like, "--family", "llama"], [*like, "--hidden", "64"]):
        with pytest.raises(SystemExit):
            tiny_main([str(tmp_path / "x"), *bad])
    with pytest.raises(ValueError):
        like_config("mistral-7b", 100, 0, 2, 0)


# ----------------------------------------------------------------------------- through `swarmserve up`
def _up_likes() -> list[Any]:
    every = bool(os.environ.get("SWARMSERVE_ALL_LIKES"))
    skip = pytest.mark.skip(reason="SWARMSERVE_ALL_LIKES=1 runs it")
    params = []
    for name in FACTS:
        marks = [] if every or name in UP_DEFAULT else [skip]
        params.append(pytest.param(name, marks=marks))
    return params


@pytest.fixture(scope="module", params=_up_likes())
def up(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """(replica dir, OpenAI base URL, DHT multiaddr) of ``swarmserve up --model DIR`` with default flags."""
    from tests.test_cli_up import START_TIMEOUT, URL_LINE, Cli, _free_port

    name = request.param
    model_dir = str(make_like_model(tmp_path_factory.mktemp("up") / name, name, num_layers=LAYERS, seed=0))
    cli = Cli.start("up", "--model", model_dir, "--port", str(_free_port()))
    try:
        dht = cli.wait_for(re.compile(r"DHT at (\S+)"), START_TIMEOUT).group(1)
        base_url = cli.wait_for(URL_LINE, START_TIMEOUT).group(1)
        yield model_dir, base_url, dht
    finally:
        if cli.popen.poll() is None:
            cli.popen.send_signal(signal.SIGINT)
            try:
                cli.popen.wait(30)
            except subprocess.TimeoutExpired:
                pass
        cli.kill_group()


@pytest.mark.slow
def test_swarm_matches_local_replica(up: tuple[str, str, str]) -> None:
    from swarm_client import AutoDistributedModelForCausalLM

    model_dir, _, dht = up
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    dist = AutoDistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=[dht])
    try:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, local.config.vocab_size, (2, 13), generator=g)
        with torch.no_grad():
            torch.testing.assert_close(dist(ids).logits, local(ids).logits, atol=1e-4, rtol=0)
        ids = ids[:1, :7]
        ours = dist.generate(ids, max_new_tokens=12, do_sample=False)
        assert ours.tolist() == local.generate(ids, max_new_tokens=12, do_sample=False).tolist()
    finally:
        dist.shutdown()


@pytest.mark.slow
def test_up_three_turn_chat_reuses_the_cache(up: tuple[str, str, str]) -> None:
    model_dir, base_url, _ = up
    client = openai.OpenAI(base_url=base_url, api_key="x", timeout=120, max_retries=0)
    messages: list[dict] = [{"role": "system", "content": "You answer questions about swarms."}]
    for turn, question in enumerate(["Hello! How are you today?", "Tell me a short story.", "Thanks, and why?"]):
        messages.append({"role": "user", "content": question})
        stream = client.chat.completions.create(
            model=Path(model_dir).name,
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        texts, finishes, usage_chunks = collect_stream(stream)
        (usage,) = [c.usage for c in usage_chunks]
        reference = greedy_reference(chat_prompt_ids(messages, model_dir), 8, model_dir)
        assert (texts.get(0, ""), finishes[0]) == (reference.text, reference.finish_reason), turn
        assert usage.completion_tokens == len(reference.token_ids)
        if turn:
            assert usage.prompt_tokens_details.cached_tokens > 0, turn
        messages.append({"role": "assistant", "content": texts.get(0, "")})
