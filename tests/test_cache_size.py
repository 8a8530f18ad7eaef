"""A worker's KV-cache budget follows its hardware (issue 40): ``--cache-tokens auto`` (the default) is what a
share of the free memory holds at the span's KV bytes per token, at most 8 context windows of the model;
a number is taken as given; too little memory is an error that says what to do."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from swarm_client.families.base import CacheLayout
from swarmserve.cli import build_parser
from swarmserve.cli.common import cache_tokens_arg
from worker import cache_size
from worker.cache_size import CONTEXTS_PER_SERVER, auto_cache_tokens, model_context, resolve_cache_tokens


def test_auto_is_what_the_memory_holds_capped_at_eight_contexts() -> None:
    # Llama 3.1 8B on a GPU: 8 KV heads × 128 dims × 2 (K and V) × 2 bytes × 32 layers = 128 KiB per token
    per_token = CacheLayout(8, 128).bytes_per_token(torch.float16) * 32
    assert per_token == 128 * 1024
    assert auto_cache_tokens(per_token, 20 * 2**30, 0.8, 131072) == int(20 * 2**30 * 0.8) // per_token  # 131072
    assert auto_cache_tokens(per_token, 200 * 2**30, 0.8, 131072) == CONTEXTS_PER_SERVER * 131072  # capped
    assert auto_cache_tokens(per_token, 2**30, 0.25, 131072) == 2048  # a small share of a busy machine


def test_model_context_reads_the_config_names_families_use() -> None:
    assert model_context(SimpleNamespace(max_position_embeddings=131072)) == 131072
    assert model_context(SimpleNamespace(n_positions=2048)) == 2048
    assert model_context(SimpleNamespace()) == cache_size.DEFAULT_CONTEXT  # BLOOM: ALiBi, no length


def test_resolve_takes_a_number_as_given_and_sizes_auto_from_free_memory(monkeypatch) -> None:
    layout, config = CacheLayout(4, 16), SimpleNamespace(max_position_embeddings=1 << 20)
    given = resolve_cache_tokens(300, layout, torch.float32, 2, torch.device("cpu"), config)
    assert (given.tokens, given.how) == (300, "--cache-tokens")
    per_token = layout.bytes_per_token(torch.float32) * 2  # 1 KiB
    monkeypatch.setattr(cache_size, "free_memory", lambda device: (64 * 2**20, 0.25, "RAM available"))
    auto = resolve_cache_tokens(None, layout, torch.float32, 2, torch.device("cpu"), config)
    assert auto.tokens == 16 * 2**20 // per_token and auto.how.startswith("auto: 25% of")
    monkeypatch.setattr(cache_size, "free_memory", lambda device: (2**19, 0.25, "RAM available"))
    with pytest.raises(SystemExit, match="not enough memory for a KV cache.*--cache-tokens"):
        resolve_cache_tokens(None, layout, torch.float32, 2, torch.device("cpu"), config)


def test_the_real_free_memory_gives_a_usable_cache_here() -> None:
    size = resolve_cache_tokens(None, CacheLayout(4, 16), torch.float32, 4, torch.device("cpu"), SimpleNamespace())
    assert size.tokens == CONTEXTS_PER_SERVER * cache_size.DEFAULT_CONTEXT, size  # a tiny model: capped


def test_flag_takes_auto_or_a_positive_number() -> None:
    assert cache_tokens_arg("auto") is None and cache_tokens_arg("AUTO") is None
    assert cache_tokens_arg("4096") == 4096
    for bad in ("0", "-5", "lots"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive number of token slots or 'auto'"):
            cache_tokens_arg(bad)
    parser = build_parser()
    peers = ["--initial-peers", "/ip4/127.0.0.1/tcp/31337/p2p/QmPeer"]
    assert parser.parse_args(["worker", "--model", "m", *peers]).cache_tokens is None  # auto by default
    assert parser.parse_args(["worker", "--model", "m", *peers, "--cache-tokens", "512"]).cache_tokens == 512
    assert parser.parse_args(["up"]).cache_tokens is None
