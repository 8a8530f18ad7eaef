"""What every model family provides so servers can run its blocks and clients its head.

A *block* is one transformer layer wrapped so that it runs against a KV cache we own:
``block(hidden [B, T, H], position: int, kv: (k [B, Hkv, L, D], v [B, Hkv, L, D]) | None) -> [B, T, H]``
where ``position`` is the absolute index of ``hidden[:, 0]``. With ``kv`` given, the new keys/values are
written at ``[position, position + T)`` and attention covers ``[0, position + T)``; without it the block
runs plain causal attention over ``hidden`` alone (stateless forward / backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from transformers import PretrainedConfig

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class CacheLayout:
    """Shape of one layer's cache: keys and values are each ``[batch, num_kv_heads, max_length, head_dim]``."""

    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_dim * torch.finfo(dtype).bits // 8


class Head(nn.Module):
    """The locally-run part of a model: embeddings before the blocks, final norm and LM head after."""

    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        raise NotImplementedError

    def embed_inputs(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """What the family's 🤗 model does to given ``inputs_embeds`` before the first block (identity)."""
        return inputs_embeds

    def final(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head → logits."""
        raise NotImplementedError

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Family(Protocol):
    name: str
    model_types: tuple[str, ...]

    def layer_prefix(self, index: int) -> str: ...

    def head_prefixes(self, config: PretrainedConfig) -> list[str]: ...

    def cache_layout(self, config: PretrainedConfig) -> CacheLayout: ...

    def build_block(
        self, config: PretrainedConfig, index: int, tensors: dict[str, torch.Tensor]
    ) -> nn.Module:
        """A block from ``tensors`` whose names are relative to ``layer_prefix(index)``."""

    def build_head(self, config: PretrainedConfig, tensors: dict[str, torch.Tensor]) -> Head:
        """The local head from ``tensors`` named as in the checkpoint."""


def causal_mask(position: int, num_new: int, total: int, device: torch.device) -> torch.Tensor | None:
    """Boolean ``[T, total]`` mask (True = attend) for queries at ``position..position+T-1``; None if trivial."""
    if num_new == 1:
        return None  # a single query sees every cached key
    query_pos = torch.arange(position, position + num_new, device=device)[:, None]
    key_pos = torch.arange(total, device=device)[None, :]
    return key_pos <= query_pos


def window_mask(
    position: int, num_new: int, total: int, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Causal mask that also hides keys ``window`` or more tokens behind the query (🤗's sliding overlay)."""
    if window is None or position + num_new <= window:
        return causal_mask(position, num_new, total, device)  # every key is inside the window
    query_pos = torch.arange(position, position + num_new, device=device)[:, None]
    key_pos = torch.arange(total, device=device)[None, :]
    return (key_pos <= query_pos) & (key_pos > query_pos - window)


def write_kv(kv: KV, position: int, keys: torch.Tensor, values: torch.Tensor) -> KV:
    """Store new ``keys``/``values`` ``[B, Hkv, T, D]`` at ``position`` and return the filled prefix views."""
    k_cache, v_cache = kv
    end = position + keys.shape[2]
    k_cache[:, :, position:end] = keys
    v_cache[:, :, position:end] = values
    return k_cache[:, :, :end], v_cache[:, :, :end]


def load_module(module: nn.Module, tensors: dict[str, torch.Tensor], what: str) -> nn.Module:
    """``load_state_dict(assign=True)`` with an error naming what is missing or unexpected."""
    expected = set(module.state_dict().keys())
    missing = sorted(expected - tensors.keys())
    unexpected = sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"{what}: checkpoint tensors do not match (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    module.load_state_dict(tensors, strict=True, assign=True)
    return module
