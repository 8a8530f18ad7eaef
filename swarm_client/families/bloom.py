"""BLOOM: ALiBi attention, layernorms and biases everywhere, an embedding layernorm before the blocks.

ALiBi adds ``slope_h * key_position`` to every score, with the key's *absolute* position in the sequence
(🤗 relies on softmax's shift invariance instead of using ``key - query``). So a cached step at ``position``
must build the bias over keys ``0..position+T-1``, not over its new tokens alone. The scores are computed as
🤗 computes them — ``alibi.baddbmm(q, kᵀ, beta=1, alpha=1/sqrt(D))``, softmax in float32 — so float32 results
match 🤗 to rounding and bfloat16 ones round the same way.
"""

from __future__ import annotations

import copy
import importlib
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from swarm_client.families.base import KV, CacheLayout, HeadFromLayout, HeadLayout, causal_mask, load_module, write_kv


def _modeling() -> ModuleType:
    return importlib.import_module("transformers.models.bloom.modeling_bloom")


def alibi_table(num_heads: int, total: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[H, 1, total]``: 🤗 BLOOM's ALiBi bias for keys at absolute positions ``0..total-1``."""
    ones = torch.ones(1, total, dtype=torch.long, device=device)
    return _modeling().build_alibi_tensor(ones, num_heads, dtype)


class BloomBlock(nn.Module):
    """One BLOOM layer against our cache; reuses 🤗's layernorms, projections and MLP."""

    def __init__(self, layer: nn.Module, config: PretrainedConfig):
        super().__init__()
        self.layer = layer
        attn = layer.self_attention
        self.num_heads = attn.num_heads
        self.head_dim = attn.head_dim
        self.inv_norm_factor = attn.inv_norm_factor
        self.beta = attn.beta
        self.post_ln_residual = bool(config.apply_residual_connection_post_layernorm)
        self.pretraining_tp = config.pretraining_tp
        self.slow_but_exact = config.slow_but_exact

    def _dense(self, context: torch.Tensor) -> torch.Tensor:
        dense = self.layer.self_attention.dense
        if self.pretraining_tp > 1 and self.slow_but_exact:
            # as BloomAttention: the projection summed slice by slice as it was trained, and (like 🤗) no bias
            slices = dense.weight.shape[-1] / self.pretraining_tp
            out = torch.zeros_like(context)
            for i in range(self.pretraining_tp):
                lo, hi = int(i * slices), int((i + 1) * slices)
                out = out + F.linear(context[:, :, lo:hi], dense.weight[:, lo:hi])
            return out
        return dense(context)

    def _attention(self, x: torch.Tensor, position: int, kv: KV | None) -> torch.Tensor:
        batch, length, _ = x.shape
        heads, d = self.num_heads, self.head_dim
        fused = self.layer.self_attention.query_key_value(x).view(batch, length, heads, 3, d)
        q, k, v = (fused[..., i, :].transpose(1, 2) for i in range(3))  # [B, H, T, D]
        if kv is not None:
            k, v = write_kv(kv, position, k, v)  # [B, H, position + T, D]
        total = k.shape[2]
        q = q.reshape(batch * heads, length, d)
        k = k.reshape(batch * heads, total, d).transpose(-1, -2)
        v = v.reshape(batch * heads, total, d)
        alibi = alibi_table(heads, total, x.dtype, x.device).repeat(batch, 1, 1)  # [B*H, 1, total]
        scores = alibi.baddbmm(batch1=q, batch2=k, beta=self.beta, alpha=self.inv_norm_factor)
        scores = scores.view(batch, heads, length, total)
        mask = causal_mask(position, length, total, x.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        context = torch.bmm(probs.view(batch * heads, length, total), v)  # [B*H, T, D]
        context = context.view(batch, heads, length, d).permute(0, 2, 1, 3).reshape(batch, length, heads * d)
        return self._dense(context)

    def forward(self, hidden: torch.Tensor, position: int = 0, kv: KV | None = None) -> torch.Tensor:
        # mirrors 🤗 BloomBlock.forward (dropout_add is a plain residual add at inference)
        layer = self.layer
        ln = layer.input_layernorm(hidden)
        residual = ln if self.post_ln_residual else hidden
        attn_out = residual + self._attention(ln, position, kv)
        ln = layer.post_attention_layernorm(attn_out)
        residual = ln if self.post_ln_residual else attn_out
        return layer.mlp(ln, residual)


class BloomFamily(HeadFromLayout):
    name = "bloom"
    model_types = ("bloom",)
    # 🤗 BloomModel applies the embedding layernorm to inputs_embeds too, whether it computed them or not
    head_layout = HeadLayout(
        embeddings="transformer.word_embeddings",
        norm="transformer.ln_f",
        embed_norm="transformer.word_embeddings_layernorm",
    )

    def layer_prefix(self, index: int) -> str:
        return f"transformer.h.{index}."

    def cache_layout(self, config: PretrainedConfig) -> CacheLayout:
        return CacheLayout(config.n_head, config.hidden_size // config.n_head)

    def build_block(
        self, config: PretrainedConfig, index: int, tensors: dict[str, torch.Tensor]
    ) -> nn.Module:
        config = copy.deepcopy(config)
        with torch.device("meta"):
            layer = _modeling().BloomBlock(config, layer_idx=index)
        load_module(layer, tensors, f"block {index}")
        return BloomBlock(layer, config).eval()
