"""Falcon: every decoder variant transformers 5.x implements, served against our KV cache.

The variants, chosen by the config exactly as ``FalconDecoderLayer`` chooses them:

- ``new_decoder_architecture`` (Falcon-40B/180B, Falcon2): grouped KV heads packed per group in
  ``query_key_value``; attention and MLP in parallel from two layernorms (``ln_attn``, ``ln_mlp``) or one
  (``num_ln_in_parallel_attn == 1``, Falcon2-11B);
- the older layout (Falcon-7B): ``multi_query`` (one KV head) or full multi-head, attention and MLP either
  in parallel from one layernorm (``parallel_attn``) or sequential with ``post_attention_layernorm``;
- positions by rotary embeddings, or by ALiBi when ``config.alibi`` (Falcon-RW), with 🤗's own bias table
  (its slopes are rounded to bfloat16, so we call 🤗's function rather than re-derive it).

The block reuses the 🤗 layer's submodules (layernorms, ``FalconLinear`` projections, MLP) and owns the
attention arithmetic; the cache keeps the real number of KV heads, not 🤗's per-query-head broadcast.
"""

from __future__ import annotations

import copy
import importlib
import math
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from swarm_client.families.base import KV, CacheLayout, HeadFromLayout, HeadLayout, causal_mask, load_module, write_kv
from swarm_client.families.llama import RotaryTable, attend, rotate_half


def _modeling() -> ModuleType:
    return importlib.import_module("transformers.models.falcon.modeling_falcon")


def num_kv_heads(config: PretrainedConfig) -> int:
    """KV heads a Falcon layer really computes (before 🤗 broadcasts them to every query head)."""
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


def alibi_bias(
    num_heads: int,
    head_dim: int,
    position: int,
    num_new: int,
    total: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Additive scores bias ``[1, H, T, total]`` (``T`` may broadcast), as 🤗 Falcon builds its SDPA mask.

    ALiBi over absolute key positions ``0..total-1`` divided by ``sqrt(head_dim)``, causal positions filled
    with the dtype's minimum.
    """
    ones = torch.ones(1, total, dtype=torch.long, device=device)
    alibi = _modeling().build_alibi_tensor(ones, num_heads, dtype=dtype)[None] / math.sqrt(head_dim)
    mask = causal_mask(position, num_new, total, device)
    return alibi if mask is None else alibi.masked_fill(~mask, torch.finfo(dtype).min)


class FalconBlock(nn.Module):
    """One Falcon decoder layer (any variant) running against our cache."""

    def __init__(self, layer: nn.Module, rotary: nn.Module | None):
        super().__init__()
        self.layer = layer
        config = layer.config  # the layer's own copy, after its __init__ filled num_ln_in_parallel_attn
        attn = layer.self_attention
        self.num_heads = attn.num_heads
        self.head_dim = attn.head_dim
        self.num_kv_heads = num_kv_heads(config)
        self.scaling = attn.inv_norm_factor
        self.new_architecture = bool(config.new_decoder_architecture)
        self.multi_query = bool(config.multi_query)
        self.parallel_attn = bool(config.parallel_attn)
        self.num_ln = config.num_ln_in_parallel_attn
        self.alibi = bool(config.alibi)
        self.rotary = None if rotary is None else RotaryTable(rotary)

    def _split_heads(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B, T, (H + 2 Hkv) D]`` → q ``[B, H, T, D]``, k/v ``[B, Hkv, T, D]`` in 🤗's packing order."""
        batch, length, _ = fused.shape
        d = self.head_dim
        if self.new_architecture:
            # per KV group: its query heads, then its key, then its value
            qkv = fused.view(batch, length, self.num_kv_heads, self.num_heads // self.num_kv_heads + 2, d)
            q = qkv[:, :, :, :-2].reshape(batch, length, self.num_heads, d)
            k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        elif not self.multi_query:
            qkv = fused.view(batch, length, self.num_heads, 3, d)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        else:
            qkv = fused.view(batch, length, self.num_heads + 2, d)
            q, k, v = qkv[:, :, :-2], qkv[:, :, -2:-1], qkv[:, :, -1:]
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _attention(self, x: torch.Tensor, position: int, kv: KV | None) -> torch.Tensor:
        batch, length, _ = x.shape
        attn = self.layer.self_attention
        q, k, v = self._split_heads(attn.query_key_value(x))
        if self.rotary is not None:
            cos, sin = self.rotary(x, position, length)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        if kv is not None:
            k, v = write_kv(kv, position, k, v)  # [B, Hkv, position + T, D]
        if self.rotary is not None:
            out = attend(q, k, v, position, self.scaling)
        else:
            bias = alibi_bias(self.num_heads, self.head_dim, position, length, k.shape[2], x.dtype, x.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=q.shape[1] != k.shape[1])
            out = out.transpose(1, 2).reshape(batch, length, -1)
        return attn.dense(out)

    def forward(self, hidden: torch.Tensor, position: int = 0, kv: KV | None = None) -> torch.Tensor:
        # mirrors FalconDecoderLayer.forward (dropout is identity at inference), including its addition order
        layer = self.layer
        residual = hidden
        if self.new_architecture and self.num_ln == 2:
            attn_in, mlp_in = layer.ln_attn(hidden), layer.ln_mlp(hidden)
        else:
            attn_in = layer.input_layernorm(hidden)
        attn_out = self._attention(attn_in, position, kv)
        if not self.new_architecture:
            if self.parallel_attn:
                mlp_in = attn_in
            else:
                residual = residual + attn_out
                mlp_in = layer.post_attention_layernorm(residual)
        if self.new_architecture and self.parallel_attn and self.num_ln == 1:
            mlp_in = attn_in
        mlp_out = layer.mlp(mlp_in)
        if self.new_architecture or self.parallel_attn:
            mlp_out = mlp_out + attn_out
        return residual + mlp_out


class FalconFamily(HeadFromLayout):
    name = "falcon"
    model_types = ("falcon",)
    head_layout = HeadLayout(embeddings="transformer.word_embeddings", norm="transformer.ln_f")

    def layer_prefix(self, index: int) -> str:
        return f"transformer.h.{index}."

    def cache_layout(self, config: PretrainedConfig) -> CacheLayout:
        return CacheLayout(num_kv_heads(config), config.hidden_size // config.num_attention_heads)

    def build_block(
        self, config: PretrainedConfig, index: int, tensors: dict[str, torch.Tensor]
    ) -> nn.Module:
        module = _modeling()
        # the layer picks its attention class by this name and writes num_ln_in_parallel_attn into its config
        config = copy.deepcopy(config)
        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            layer = module.FalconDecoderLayer(config, layer_idx=index)
        load_module(layer, tensors, f"block {index}")
        rotary = None if config.alibi else module.FalconRotaryEmbedding(config)
        return FalconBlock(layer, rotary).eval()
