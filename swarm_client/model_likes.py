"""Tiny replicas of real checkpoints: ``swarmserve tiny-model OUT --like NAME``.

``LIKES`` holds, for each model, the values of its published ``config.json`` (and ``generation_config.json``'s
EOS ids) that shape the computation, written here from the checkpoint named in ``source`` — never downloaded.
``like_config`` shrinks only the sizes (layers, hidden size, heads, intermediate size, vocabulary → the tiny
tokenizer's) and keeps the rest as published: context window, rope theta and scaling, norms and their eps,
biases, tied or untied head, ALiBi, MoE routing, sliding-window settings. So whatever a real config does that
breaks serving (a 131072-token window, ``llama3`` rope scaling, a 16:1 GQA ratio, non-power-of-two ALiBi heads)
breaks a replica the same way, in seconds and offline.

Shrinking, per entry (``tiny_heads``/``tiny_kv_heads``/``tiny_head_dim``): the GQA ratio ``heads / kv_heads`` is
kept exactly, with 2 KV heads (so grouping bugs show) and head_dim 8 (4 rotary frequencies: at theta 5e5 and
``original_max_position_embeddings`` 8192 they fall in all three ``llama3`` bands — kept, smoothed, scaled);
the intermediate size keeps its ratio to the hidden size; Mixtral keeps all 8 experts and top-2. What a
replica cannot copy: BOS (the tiny tokenizer has none, so ``bos_token_id`` is null) and each EOS token (a
list of EOS ids becomes ``[<|im_end|>, <|endoftext|>]``, a single id ``<|im_end|>``).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

from swarm_client.random_weights import INIT_STD, save_random_model
from swarm_client.tiny_tokenizer import ENDOFTEXT, IM_END, build_tokenizer

LLAMA31_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
#: Qwen/Qwen2.5-72B-Instruct config.json as shipped (two entries below use it)
QWEN25_72B: dict[str, Any] = {
    "model_type": "qwen2", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "intermediate_size": 29568, "hidden_act": "silu",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 80,
    "tie_word_embeddings": False, "vocab_size": 152064, "bos_token_id": 151643,
    "eos_token_id": 151645,
}


@dataclass(frozen=True)
class ModelLike:
    """One real checkpoint: its published config values and how its replica is shrunk."""

    source: str  # the 🤗 repository whose config.json these values are
    config: dict[str, Any]  # published config.json keys (sizes included, as published)
    context_window: int  # what the model serves (the tokenizer's model_max_length): see each entry
    eos_is_list: bool  # generation_config's eos_token_id is a list (else one id)
    tiny_heads: int
    tiny_kv_heads: int  # == tiny_heads for multi-head attention
    tiny_head_dim: int = 8
    notes: str = ""


LIKES: dict[str, ModelLike] = {
    # meta-llama/Llama-3.1-405B-Instruct config.json (+ generation_config eos [128001, 128008, 128009])
    "llama-3.1-405b": ModelLike(
        source="meta-llama/Llama-3.1-405B-Instruct",
        config={
            "model_type": "llama", "hidden_size": 16384, "num_hidden_layers": 126, "num_attention_heads": 128,
            "num_key_value_heads": 8, "intermediate_size": 53248, "hidden_act": "silu",
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": LLAMA31_ROPE, "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
            "tie_word_embeddings": False, "vocab_size": 128256, "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009],
        },
        context_window=131072, eos_is_list=True, tiny_heads=32, tiny_kv_heads=2,
    ),
    # meta-llama/Llama-3.1-8B-Instruct config.json
    "llama-3.1-8b": ModelLike(
        source="meta-llama/Llama-3.1-8B-Instruct",
        config={
            "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "hidden_act": "silu",
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": LLAMA31_ROPE, "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
            "tie_word_embeddings": False, "vocab_size": 128256, "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009],
        },
        context_window=131072, eos_is_list=True, tiny_heads=8, tiny_kv_heads=2,
    ),
    # mistralai/Mixtral-8x22B-Instruct-v0.1 config.json (the base v0.1 has vocab 32000; same otherwise)
    "mixtral-8x22b": ModelLike(
        source="mistralai/Mixtral-8x22B-Instruct-v0.1",
        config={
            "model_type": "mixtral", "hidden_size": 6144, "num_hidden_layers": 56, "num_attention_heads": 48,
            "num_key_value_heads": 8, "intermediate_size": 16384, "hidden_act": "silu",
            "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
            "max_position_embeddings": 65536, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
            "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32768,
            "bos_token_id": 1, "eos_token_id": 2,
        },
        context_window=65536, eos_is_list=False, tiny_heads=12, tiny_kv_heads=2,
    ),
    # tiiuae/falcon-40b config.json: no max_position_embeddings / rope_theta / ffn_hidden_size keys, so
    # FalconConfig's defaults apply (2048, 10000, 4 × hidden); the head is tied (FalconConfig's default)
    "falcon-40b": ModelLike(
        source="tiiuae/falcon-40b",
        config={
            "model_type": "falcon", "hidden_size": 8192, "num_hidden_layers": 60, "num_attention_heads": 128,
            "num_kv_heads": 8, "new_decoder_architecture": True, "parallel_attn": True, "bias": False,
            "alibi": False, "apply_residual_connection_post_layernorm": False,
            "layer_norm_epsilon": 1e-5, "vocab_size": 65024, "bos_token_id": 11, "eos_token_id": 11,
        },
        context_window=2048, eos_is_list=False, tiny_heads=32, tiny_kv_heads=2,
    ),
    # bigscience/bloom config.json: no max_position_embeddings key at all (ALiBi); trained on 2048 tokens
    "bloom-176b": ModelLike(
        source="bigscience/bloom",
        config={
            "model_type": "bloom", "hidden_size": 14336, "n_layer": 70, "n_head": 112,
            "layer_norm_epsilon": 1e-5, "apply_residual_connection_post_layernorm": False,
            "pretraining_tp": 4, "slow_but_exact": False, "vocab_size": 250880, "bos_token_id": 1,
            "eos_token_id": 2, "pad_token_id": 3, "unk_token_id": 0,
        },
        context_window=2048, eos_is_list=False, tiny_heads=7, tiny_kv_heads=7, tiny_head_dim=16,
        notes="112 = 7 × 16 heads: 7 keeps ALiBi's non-power-of-two slope path; 2048 is the training length",
    ),
    # Qwen/Qwen2.5-72B-Instruct config.json as shipped: 32768 tokens, no rope_scaling (the model card's
    # optional YaRN ×4 to 131072 is not in the file)
    "qwen2.5-72b": ModelLike(
        source="Qwen/Qwen2.5-72B-Instruct",
        config=QWEN25_72B,
        context_window=32768, eos_is_list=True, tiny_heads=16, tiny_kv_heads=2,
        notes="generation_config eos_token_id is [151645, 151643]",
    ),
    # the same, with the rope_scaling block Qwen's model card says to add for 131072 tokens (max_position_embeddings
    # stays 32768 there); Qwen2.5's tokenizer_config.json says model_max_length 131072
    "qwen2.5-72b-yarn": ModelLike(
        source="Qwen/Qwen2.5-72B-Instruct + model card YaRN block",
        config={
            **QWEN25_72B,
            "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
        },
        context_window=131072, eos_is_list=True, tiny_heads=16, tiny_kv_heads=2,
        notes="the gateway takes its window from max_position_embeddings (32768), not the YaRN-extended 131072",
    ),
    # mistralai/Mistral-7B-Instruct-v0.3 config.json
    "mistral-7b": ModelLike(
        source="mistralai/Mistral-7B-Instruct-v0.3",
        config={
            "model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "hidden_act": "silu",
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
            "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32768,
            "bos_token_id": 1, "eos_token_id": 2,
        },
        context_window=32768, eos_is_list=False, tiny_heads=8, tiny_kv_heads=2,
    ),
}

#: keys that name sizes, per spelling: shrunk; every other published key is kept as is
LAYER_KEYS = ("num_hidden_layers", "n_layer")
HEAD_KEYS = ("num_attention_heads", "n_head")
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads")
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def like_names() -> list[str]:
    return list(LIKES)


def get_like(name: str) -> ModelLike:
    try:
        return LIKES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r} for --like; choose one of {', '.join(LIKES)}") from None


def published_layers(like: ModelLike) -> int:
    return next(like.config[k] for k in LAYER_KEYS if k in like.config)


def _shrunk(like: ModelLike, vocab_size: int, num_layers: int, eos: int | list[int], pad: int) -> dict[str, Any]:
    """The published config with sizes replaced (see the module docstring) and token ids the tiny tokenizer's."""
    real = like.config
    hidden = like.tiny_heads * like.tiny_head_dim
    out = {k: v for k, v in real.items() if k not in TOKEN_KEYS}
    for key in LAYER_KEYS:
        if key in out:
            out[key] = num_layers
    for key in HEAD_KEYS:
        if key in out:
            out[key] = like.tiny_heads
    for key in KV_HEAD_KEYS:
        if key in out:
            out[key] = like.tiny_kv_heads
    if "intermediate_size" in out:  # keep its ratio to the hidden size
        out["intermediate_size"] = round(real["intermediate_size"] * hidden / real["hidden_size"])
    if "max_window_layers" in out:  # a layer count: scaled with the layers
        out["max_window_layers"] = round(real["max_window_layers"] * num_layers / published_layers(like))
    out.update(hidden_size=hidden, vocab_size=vocab_size, bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    return out


def like_config(name: str, vocab_size: int, num_layers: int, eos: int | list[int], pad: int) -> Any:
    """The ``PretrainedConfig`` of the tiny replica of ``name`` (built from the published keys, so
    transformers converts ``rope_scaling``/``rope_theta`` exactly as it does for the real checkpoint)."""
    from transformers import AutoConfig

    if num_layers <= 0:
        raise ValueError(f"need at least one layer, got {num_layers}")
    like = get_like(name)
    kwargs = _shrunk(like, vocab_size, num_layers, eos, pad)
    model_type = kwargs.pop("model_type")
    return AutoConfig.for_model(model_type, initializer_range=INIT_STD, dtype="float32", **kwargs)


def make_like_model(out_dir: str | pathlib.Path, name: str, num_layers: int = 4, seed: int = 0) -> pathlib.Path:
    """Write the tiny replica of ``name`` (random weights, the tiny tokenizer) to ``out_dir``; return it."""
    like = get_like(name)
    tokenizer = build_tokenizer(like.config["model_type"])
    tokenizer.model_max_length = like.context_window  # the gateway's window and max_tokens default
    im_end, endoftext = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    eos: int | list[int] = [im_end, endoftext] if like.eos_is_list else im_end
    config = like_config(name, len(tokenizer), num_layers, eos, endoftext)
    return save_random_model(out_dir, config, tokenizer, seed, INIT_STD)
