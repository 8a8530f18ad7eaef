"""Write a small random-weight model with a real tokenizer, for tests and demos that must run offline.

The model is a genuine 🤗 checkpoint (``config.json``, ``model.safetensors``, ``generation_config.json``)
of one of the families swarmserve serves, so every code path (rotary scaling, GQA, MoE, ALiBi, biases,
tied or untied heads) can be checked against ``AutoModelForCausalLM.from_pretrained(OUT)`` without the
Hub. The tokenizer (``tiny_tokenizer``) is a byte-level BPE trained on a few built-in paragraphs: it round-trips any
unicode text and carries a ChatML chat template, so chat-template paths (the OpenAI chat API) work end to end.

Everything is deterministic: the same ``seed`` gives byte-identical ``model.safetensors``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable
from typing import Any

# the random-weight writer and the tokenizer are shared with the replicas (model_likes); importable from here too
from swarm_client.random_weights import (  # noqa: F401
    FINAL_NORM_WEIGHTS,
    INIT_STD,
    _perturb_constant_params,
    save_random_model,
)
from swarm_client.tiny_tokenizer import (  # noqa: F401
    CHAT_TEMPLATE,
    CORPUS,
    ENDOFTEXT,
    IM_END,
    IM_START,
    MAX_POSITIONS,
    QWEN2_PRETOKENIZE_REGEX,
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB_SIZE,
    build_tokenizer,
)

FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "mixtral", "falcon", "bloom")


def _common(vocab_size: int, hidden: int, layers: int, eos: list[int], pad: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": INIT_STD,
        "bos_token_id": None,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": "float32",
    }


def _llama_like(model_type: str, common: dict[str, Any], hidden: int) -> dict[str, Any]:
    return {
        **common,
        "model_type": model_type,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
    }


def family_config(
    family: str, vocab_size: int, hidden_size: int, num_layers: int, eos: list[int], pad: int
) -> Any:
    """The ``PretrainedConfig`` of a tiny ``family`` model (field names as transformers 5.x spells them)."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    if hidden_size % 8 or hidden_size <= 0:
        # 4 heads with an even head_dim (rotary embeddings rotate pairs of channels)
        raise ValueError(f"hidden size must be a positive multiple of 8, got {hidden_size}")
    if num_layers <= 0:
        raise ValueError(f"need at least one layer, got {num_layers}")
    common = _common(vocab_size, hidden_size, num_layers, eos, pad)
    builders: dict[str, Callable[[], dict[str, Any]]] = {
        # Llama 3.1 style: GQA, theta 5e5 and "llama3" frequency scaling (at head_dim 16 the low, smoothed
        # and high frequency bands are all hit), untied LM head.
        "llama": lambda: {
            **_llama_like("llama", common, hidden_size),
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512,
            },
        },
        # Mistral v0.2+ style: no sliding window (a mask detail block servers would have to copy).
        "mistral": lambda: {
            **_llama_like("mistral", common, hidden_size),
            "sliding_window": None,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        # Qwen2: q/k/v projections carry biases; small Qwen models tie the LM head to the embeddings.
        "qwen2": lambda: {
            **_llama_like("qwen2", common, hidden_size),
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "mixtral": lambda: {
            **_llama_like("mixtral", common, hidden_size),
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        # Falcon-40B/180B layout: grouped KV heads, two layernorms feeding parallel attention and MLP, rotary.
        "falcon": lambda: {
            **common,
            "model_type": "falcon",
            "num_attention_heads": 4,
            "num_kv_heads": 2,
            "new_decoder_architecture": True,
            "multi_query": False,
            "parallel_attn": True,
            "num_ln_in_parallel_attn": 2,
            "alibi": False,
            "bias": False,
            "ffn_hidden_size": 4 * hidden_size,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        # BLOOM: ALiBi positions, embedding layernorm, biases everywhere, tied head.
        "bloom": lambda: {
            **common,
            "model_type": "bloom",
            "n_head": 4,
            "tie_word_embeddings": True,
        },
    }
    kwargs = builders[family]()
    model_type = kwargs.pop("model_type")
    return AutoConfig.for_model(model_type, **kwargs)


def make_tiny_model(
    out_dir: str | pathlib.Path,
    family: str = "llama",
    num_layers: int = 4,
    seed: int = 0,
    hidden_size: int = 64,
) -> pathlib.Path:
    """Write a tiny random ``family`` model + tokenizer to ``out_dir``; return the directory."""
    if hidden_size > 128:
        raise ValueError(f"tiny models keep hidden size <= 128, got {hidden_size}")
    tokenizer = build_tokenizer(family)
    eos = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    pad = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = family_config(family, len(tokenizer), hidden_size, num_layers, eos, pad)
    return save_random_model(out_dir, config, tokenizer, seed, INIT_STD)


def main(argv: list[str] | None = None) -> int:
    """``swarmserve tiny-model OUT [--family F | --like NAME] [--layers N] [--seed S] [--hidden H] [--lora NAME]``."""
    from swarm_client.lora import check_adapter_name
    from swarm_client.model_likes import like_names, make_like_model
    from swarm_client.tiny_lora import make_random_lora

    parser = argparse.ArgumentParser(
        prog="swarmserve tiny-model", description="Write a small random-weight model with a real tokenizer."
    )
    parser.add_argument("out", metavar="OUT", help="output directory (created if missing)")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--family", choices=FAMILIES, default=None, help="model family (default llama)")
    kind.add_argument("--like", choices=like_names(), help="a tiny replica of this real model's config")
    parser.add_argument("--layers", type=int, default=4, help="number of transformer blocks (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="random seed; same seed, same weights")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size, a multiple of 8, at most 128")
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME",
        help="also write a random PEFT LoRA adapter of the blocks to OUT/adapters/NAME (repeatable; serve it "
        "with swarmserve worker --adapters NAME=OUT/adapters/NAME)",
    )
    args = parser.parse_args(argv)
    if args.like and args.hidden is not None:
        parser.error("--hidden cannot be combined with --like (a replica's sizes follow the real model)")
    try:
        if args.like:
            out = make_like_model(args.out, args.like, num_layers=args.layers, seed=args.seed)
        else:
            out = make_tiny_model(args.out, args.family or "llama", args.layers, args.seed, args.hidden or 64)
    except ValueError as exc:
        parser.error(str(exc))
    family = args.like or args.family or "llama"
    adapters = {
        name: str(make_random_lora(out, out / "adapters" / name, seed=args.seed + 1 + i).resolve())
        for i, name in enumerate(check_adapter_name(n) for n in args.lora)
    }
    result = {"path": str(out.resolve()), "family": family, "layers": args.layers}
    print(json.dumps({**result, "adapters": adapters} if adapters else result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
