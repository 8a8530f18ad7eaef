"""Mixtral: Mistral-shaped attention with a sparse mixture-of-experts MLP, each decoder layer served whole.

The block reuses 🤗's ``MixtralDecoderLayer`` (so routing, top-k renormalisation and the experts kernel are
exactly 🤗's) and owns only the attention arithmetic, like the Llama family. Two things differ from Llama:

- checkpoints name experts one by one (``block_sparse_moe.experts.{e}.w1/w2/w3.weight``) while the 🤗
  module in transformers 5.x holds them fused (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``down_proj``
  ``[E, H, I]``);
  ``build_block`` accepts either naming and fuses the per-expert one the way 🤗's loader does;
- a config may set ``sliding_window`` (Mistral-style local attention), which the block honours by masking.
"""

from __future__ import annotations

import copy
import importlib

import torch
from torch import nn
from transformers import PretrainedConfig

from swarm_client.families.base import load_module
from swarm_client.families.llama import LlamaBlock, LlamaFamily

#: experts kernel 🤗 picks by default in transformers 5.x (it falls back to a plain loop where unsupported)
EXPERTS_IMPLEMENTATION = "grouped_mm"


def fuse_expert_tensors(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Checkpoint names (``block_sparse_moe.experts.{e}.w1``…) → the fused 🤗 module's; others unchanged.

    ``gate_up_proj[e] = cat(w1[e], w3[e])`` (gate first, as ``chunk(2)`` in the experts forward expects) and
    ``down_proj[e] = w2[e]``, the same merge transformers' weight converter performs on load.
    """
    prefix = "block_sparse_moe."
    if not any(name.startswith(prefix) for name in tensors):
        return dict(tensors)
    out = {}
    for name, tensor in tensors.items():
        if name.startswith(prefix + "experts."):
            continue
        out["mlp." + name[len(prefix) :] if name.startswith(prefix) else name] = tensor
    try:
        w1, w2, w3 = (
            [tensors[f"{prefix}experts.{e}.{w}.weight"] for e in range(num_experts)]
            for w in ("w1", "w2", "w3")
        )
    except KeyError as exc:
        raise ValueError(f"mixtral block: expert tensor {exc} missing from the checkpoint") from exc
    out["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([g, u], dim=0) for g, u in zip(w1, w3, strict=True)]
    )
    out["mlp.experts.down_proj"] = torch.stack(w2)
    return out


class MixtralBlock(LlamaBlock):
    """``LlamaBlock`` whose layer's ``mlp`` is 🤗's sparse MoE; attention (incl. the optional sliding window)
    is the llama block's own. A distinct type so cross-session batching stays off for MoE blocks."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, sliding_window: int | None):
        super().__init__(layer, rotary, sliding_window)


class MixtralFamily(LlamaFamily):
    name = "mixtral"
    model_types = ("mixtral",)

    def build_block(
        self, config: PretrainedConfig, index: int, tensors: dict[str, torch.Tensor]
    ) -> nn.Module:
        module = importlib.import_module("transformers.models.mixtral.modeling_mixtral")
        config = copy.deepcopy(config)
        if config._experts_implementation is None:
            # unset, the experts module warns and loops in Python; a loaded 🤗 model would use this kernel
            config._experts_implementation = EXPERTS_IMPLEMENTATION
        with torch.device("meta"):
            layer = module.MixtralDecoderLayer(config, layer_idx=index)
        load_module(layer, fuse_expert_tensors(tensors, config.num_local_experts), f"block {index}")
        rotary = module.MixtralRotaryEmbedding(config)
        return MixtralBlock(layer, rotary, getattr(config, "sliding_window", None)).eval()
