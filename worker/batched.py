"""Continuous batching of steps from *different* sessions through one llama-shaped block.

Every session keeps its own KV cache (different lengths, positions and batch sizes), so only attention
runs per session; norms, projections and the MLP run once over all sessions' tokens. A step may carry one
token per sequence (decode) or many (a prompt's prefill): all tokens are flattened into rows, so a new
request's prefill shares the pass over the weights with the other sessions' decode steps instead of
costing a pass of its own. On a GPU or for wide models that turns N small matmuls into one; on small
models it removes N-1 passes of Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from swarm_client.families.base import KV, write_kv
from swarm_client.families.llama import LlamaBlock, attend, rotate_half


@dataclass
class Segment:
    """Rows ``[start, end)`` of the batch are one session's step: ``batch`` sequences of ``length`` tokens
    (row-major: sequence 0's tokens first) at ``position``, with cache ``kv``."""

    start: int
    end: int
    position: int
    kv: KV
    batch: int = 1
    length: int = 1

    def __post_init__(self) -> None:
        if self.end - self.start != self.batch * self.length:
            raise ValueError(f"segment of {self.end - self.start} rows is not {self.batch} x {self.length} tokens")


def supports_batching(block: nn.Module) -> bool:
    """Plain llama-shaped blocks (Llama, Mistral/Qwen2 without a sliding window) batch across sessions."""
    return type(block) is LlamaBlock and not getattr(block, "sliding_window", None)


def position_ids(segments: list[Segment], device: torch.device) -> torch.Tensor:
    """``[N, 1]``: each row's absolute position (one tensor built from a list, not one op per segment)."""
    ids = [seg.position + t for seg in segments for _ in range(seg.batch) for t in range(seg.length)]
    return torch.tensor(ids, dtype=torch.long, device=device)[:, None]


def rotary_tables(
    block: LlamaBlock, hidden: torch.Tensor, segments: list[Segment]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[N, 1, D]`` of every row, as ``block``'s rotary embedding computes them. The blocks of one
    model share their rotary configuration, so a span computes this once per batch, not once per layer."""
    return block.rotary.rotary(hidden, position_ids(segments, hidden.device))


def same_rotary(blocks: list[LlamaBlock]) -> bool:
    """True when every block's rotary embedding gives the same tables (same class, frequencies, scaling)."""
    first = blocks[0].rotary.rotary
    return all(
        type(b.rotary.rotary) is type(first)
        and torch.equal(b.rotary.rotary.inv_freq, first.inv_freq)
        and getattr(b.rotary.rotary, "attention_scaling", 1.0) == getattr(first, "attention_scaling", 1.0)
        for b in blocks[1:]
    )


def llama_forward_batch(
    block: LlamaBlock,
    hidden: torch.Tensor,
    segments: list[Segment],
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One token per row: ``hidden [N, 1, H]``, the rows grouped into ``segments``; same math as running
    each segment's ``[batch, length, H]`` through ``block.forward`` with its cache. ``rope``: the rows'
    cos/sin from ``rotary_tables`` when the caller shares them between layers."""
    rows = hidden.shape[0]
    layer, attn = block.layer, block.layer.self_attn
    x = layer.input_layernorm(hidden)
    q = attn.q_proj(x).view(rows, -1, block.head_dim)  # [N, Hq, D]
    k = attn.k_proj(x).view(rows, -1, block.head_dim)  # [N, Hkv, D]
    v = attn.v_proj(x).view(rows, -1, block.head_dim)
    cos, sin = rope if rope is not None else rotary_tables(block, x, segments)  # [N, 1, D]: broadcast over heads
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    outs = []
    for seg in segments:

        def per_sequence(t: torch.Tensor, seg: Segment = seg) -> torch.Tensor:  # [rows, H, D] -> [B, H, T, D]
            return t[seg.start : seg.end].view(seg.batch, seg.length, -1, block.head_dim).transpose(1, 2)

        keys, values = write_kv(seg.kv, seg.position, per_sequence(k), per_sequence(v))
        out = attend(per_sequence(q), keys, values, seg.position, block.scaling)  # [B, T, Hq * D]
        outs.append(out.reshape(seg.end - seg.start, 1, -1))
    out = torch.cat(outs, 0) if len(outs) > 1 else outs[0]
    hidden = hidden + attn.o_proj(out)
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))
