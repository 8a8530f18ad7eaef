"""Continuous batching of decode steps from *different* sessions through one llama-shaped block.

Every session keeps its own KV cache (different lengths, positions and batch sizes), so only attention
runs per session; norms, projections and the MLP run once over all sessions' rows. On a GPU or for
wide models that turns N small matmuls into one; on small models it removes N-1 passes of Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from swarm_client.families.base import KV, write_kv
from swarm_client.families.llama import LlamaBlock, attend, rotate_half


@dataclass
class Segment:
    """Rows ``[start, end)`` of the batch belong to one session at ``position`` with cache ``kv``."""

    start: int
    end: int
    position: int
    kv: KV


def supports_batching(block: nn.Module) -> bool:
    """Plain llama-shaped blocks (Llama, Mistral/Qwen2 without a sliding window) batch across sessions."""
    return type(block) is LlamaBlock and not getattr(block, "sliding_window", None)


def llama_forward_batch(block: LlamaBlock, hidden: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
    """One decode token per row: ``hidden [N, 1, H]``, rows grouped into ``segments``."""
    rows = hidden.shape[0]
    layer, attn = block.layer, block.layer.self_attn
    x = layer.input_layernorm(hidden)
    q = attn.q_proj(x).view(rows, 1, -1, block.head_dim).transpose(1, 2)  # [N, Hq, 1, D]
    k = attn.k_proj(x).view(rows, 1, -1, block.head_dim).transpose(1, 2)  # [N, Hkv, 1, D]
    v = attn.v_proj(x).view(rows, 1, -1, block.head_dim).transpose(1, 2)
    position_ids = torch.empty(rows, 1, dtype=torch.long, device=hidden.device)
    for seg in segments:
        position_ids[seg.start : seg.end] = seg.position
    cos, sin = block.rotary.rotary(x, position_ids)  # [N, 1, D]
    cos, sin = cos[:, None], sin[:, None]
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    outs = []
    for seg in segments:
        keys, values = write_kv(seg.kv, seg.position, k[seg.start : seg.end], v[seg.start : seg.end])
        outs.append(attend(q[seg.start : seg.end], keys, values, seg.position, block.scaling))
    out = torch.cat(outs, 0) if len(outs) > 1 else outs[0]
    hidden = hidden + attn.o_proj(out)
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))
