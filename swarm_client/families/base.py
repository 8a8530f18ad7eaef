"""What every model family provides so servers can run its blocks and clients its head.

A *block* is one transformer layer wrapped so that it runs against a KV cache we own:
``block(hidden [B, T, H], position: int, kv: (k [B, Hkv, L, D], v [B, Hkv, L, D]) | None) -> [B, T, H]``
where ``position`` is the absolute index of ``hidden[:, 0]``. With ``kv`` given, the new keys/values are
written at ``[position, position + T)`` and attention covers ``[0, position + T)``; without it the block
runs plain causal attention over ``hidden`` alone (stateless forward / backward).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class CacheLayout:
    """Shape of one layer's cache: keys and values are each ``[batch, num_kv_heads, max_length, head_dim]``."""

    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_dim * torch.finfo(dtype).bits // 8


class Head(nn.Module):
    """The locally-run part of a model: embeddings (+ an optional norm) before the blocks, final norm and
    LM head after. ``lm_head`` may share its weight with ``embeddings`` (tied: one tensor, see
    ``headless_model``)."""

    def __init__(self, embeddings: nn.Module, norm: nn.Module, lm_head: nn.Module, embed_norm: nn.Module | None = None):
        super().__init__()
        self.embeddings = embeddings
        self.embed_norm = embed_norm
        self.norm = norm
        self.lm_head = lm_head

    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        return self.embed_inputs(self.embeddings(input_ids))

    def embed_inputs(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """What the family's 🤗 model does to given ``inputs_embeds`` before the first block: its embedding
        norm if it has one (🤗 BLOOM applies it to given ``inputs_embeds`` too), else nothing."""
        return inputs_embeds if self.embed_norm is None else self.embed_norm(inputs_embeds)

    def final(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head → logits."""
        return self.lm_head(self.norm(hidden))

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


@dataclass(frozen=True)
class HeadLayout:
    """Where a family's head modules sit in its 🤗 CausalLM (dotted names); the LM head is ``lm_head``."""

    embeddings: str
    norm: str
    embed_norm: str | None = None

    def prefixes(self) -> list[str]:
        """Checkpoint name prefixes of the head's tensors."""
        names = [self.embeddings, self.embed_norm, self.norm, "lm_head"]
        return [f"{name}." for name in names if name is not None]

    def build(self, config: PretrainedConfig, tensors: dict[str, torch.Tensor]) -> Head:
        """The head from checkpoint ``tensors`` (an absent ``lm_head`` of a tied model shares the embeddings)."""
        model = headless_model(config, tensors, f"{self.embeddings}.weight")
        embed_norm = None if self.embed_norm is None else model.get_submodule(self.embed_norm)
        return Head(model.get_submodule(self.embeddings), model.get_submodule(self.norm), model.lm_head, embed_norm)


def headless_model(config: PretrainedConfig, tensors: dict[str, torch.Tensor], embed_key: str) -> nn.Module:
    """The family's 🤗 CausalLM with zero layers, holding exactly ``tensors`` (tied LM head resolved)."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = 0
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tensors = dict(tensors)
    state_keys = set(model.state_dict().keys())
    tied = getattr(config, "tie_word_embeddings", False)
    lm_key = "lm_head.weight"
    if lm_key in state_keys and lm_key not in tensors:
        if not tied:
            raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is False")
        tensors[lm_key] = tensors[embed_key]
    load_module(model, {k: v for k, v in tensors.items() if k in state_keys}, "model head")
    model.eval()
    return model


class HeadFromLayout:
    """A family's ``head_prefixes`` and ``build_head`` (see ``Family``) from its class attribute ``head_layout``."""

    head_layout: ClassVar[HeadLayout]

    def head_prefixes(self, config: PretrainedConfig) -> list[str]:
        return self.head_layout.prefixes()

    def build_head(self, config: PretrainedConfig, tensors: dict[str, torch.Tensor]) -> Head:
        return self.head_layout.build(config, tensors)


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
