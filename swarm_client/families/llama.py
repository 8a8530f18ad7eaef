"""Llama-shaped decoder families: Llama 2/3.x, Mistral, Qwen2 (qkv bias) — RMSNorm, rotary, GQA, SwiGLU.

Mistral and Qwen2 may attend within a sliding window; ``sliding_window(config, index)`` says where 🤗 does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from swarm_client.families.base import KV, CacheLayout, HeadFromLayout, HeadLayout, load_module, window_mask, write_kv


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryTable(nn.Module):
    """cos/sin for absolute positions, from the model's own rotary class (so llama3/yarn scaling is exact)."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.rotary = rotary

    def forward(self, x: torch.Tensor, position: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        position_ids = torch.arange(position, position + length, device=x.device)[None]
        cos, sin = self.rotary(x, position_ids)  # [1, T, D]
        return cos[:, None], sin[:, None]  # [1, 1, T, D]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position: int,
    scaling: float,
    window: int | None = None,
) -> torch.Tensor:
    """q ``[B, Hq, T, D]``, k/v ``[B, Hkv, S, D]`` → ``[B, T, Hq * D]``, causal from ``position``.

    ``window``: keys ``window`` or more tokens behind a query are hidden too (sliding-window attention).
    """
    num_new, total = q.shape[2], k.shape[2]
    mask = window_mask(position, num_new, total, window, q.device)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.transpose(1, 2).reshape(q.shape[0], num_new, -1)


class LlamaBlock(nn.Module):
    """One decoder layer; reuses the 🤗 layer's submodules and owns only the attention arithmetic."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, sliding_window: int | None = None):
        super().__init__()
        self.layer = layer
        self.rotary = RotaryTable(rotary)
        self.sliding_window = sliding_window
        attn = layer.self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling

    def forward(self, hidden: torch.Tensor, position: int = 0, kv: KV | None = None) -> torch.Tensor:
        batch, length, _ = hidden.shape
        attn = self.layer.self_attn
        x = self.layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, position, length)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if kv is not None:
            k, v = write_kv(kv, position, k, v)
        out = attend(q, k, v, position, self.scaling, self.sliding_window)
        hidden = hidden + attn.o_proj(out)
        return hidden + self.layer.mlp(self.layer.post_attention_layernorm(hidden))


def sliding_window(config: PretrainedConfig, index: int) -> int | None:
    """The attention window 🤗 uses in layer ``index``, or None for full causal attention.

    Mistral: ``config.sliding_window`` in every layer (🤗 ignores ``layer_types`` there). Qwen2: only layers
    whose ``layer_types`` entry is ``"sliding_attention"`` — the config derives them from
    ``use_sliding_window`` and ``max_window_layers`` (and nulls ``sliding_window`` unless it is used).
    Llama has no window.
    """
    window = getattr(config, "sliding_window", None)
    if window is None or config.model_type == "llama":
        return None
    if config.model_type == "qwen2":
        layer_types = getattr(config, "layer_types", None) or []
        return window if index < len(layer_types) and layer_types[index] == "sliding_attention" else None
    return int(window)


class LlamaFamily(HeadFromLayout):
    name = "llama"
    model_types = ("llama", "mistral", "qwen2")
    head_layout = HeadLayout(embeddings="model.embed_tokens", norm="model.norm")

    def layer_prefix(self, index: int) -> str:
        return f"model.layers.{index}."

    def cache_layout(self, config: PretrainedConfig) -> CacheLayout:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return CacheLayout(config.num_key_value_heads or config.num_attention_heads, head_dim)

    def _decoder_layer_class(self, config: PretrainedConfig) -> type[nn.Module]:
        import importlib

        module = importlib.import_module(
            f"transformers.models.{config.model_type}.modeling_{config.model_type}"
        )
        prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[config.model_type]
        return getattr(module, f"{prefix}DecoderLayer"), getattr(module, f"{prefix}RotaryEmbedding")

    def build_block(
        self, config: PretrainedConfig, index: int, tensors: dict[str, torch.Tensor]
    ) -> nn.Module:
        layer_cls, rotary_cls = self._decoder_layer_class(config)
        with torch.device("meta"):
            layer = layer_cls(config, layer_idx=index)
        load_module(layer, tensors, f"block {index}")
        # the rotary table stays float32 whatever the weights' dtype, as in 🤗 (inv_freq is not a weight)
        return LlamaBlock(layer, rotary_cls(config), sliding_window(config, index)).eval()
