"""Running a span of blocks: with a session's KV cache, statelessly, and backward for fine-tuning."""

from __future__ import annotations

import torch
from torch import nn

from worker.cache import SessionCache


class SpanRunner:
    def __init__(self, blocks: list[nn.Module], dtype: torch.dtype, device: torch.device):
        self.blocks = blocks
        self.dtype = dtype
        self.device = device

    @torch.inference_mode()
    def inference_step(
        self,
        cache: SessionCache,
        hidden: torch.Tensor,
        position: int,
        output_hidden_states: bool = False,
        blocks: slice = slice(None),
    ) -> torch.Tensor:
        """Run ``hidden`` [B, T, H] at ``position`` through ``blocks`` (relative to this span) with ``cache``."""
        x = hidden.to(self.device, self.dtype)
        states = []
        for block, kv in zip(self.blocks[blocks], cache.layer_kv(), strict=True):
            x = block(x, position, kv)
            if output_hidden_states:
                states.append(x)
        cache.position = position + hidden.shape[1]
        return torch.stack(states) if output_hidden_states else x

    @torch.inference_mode()
    def forward(
        self, hidden: torch.Tensor, output_hidden_states: bool = False, blocks: slice = slice(None)
    ) -> torch.Tensor:
        x = hidden.to(self.device, self.dtype)
        states = []
        for block in self.blocks[blocks]:
            x = block(x, 0, None)
            if output_hidden_states:
                states.append(x)
        return torch.stack(states) if output_hidden_states else x

    def backward(self, hidden: torch.Tensor, grad_output: torch.Tensor, blocks: slice = slice(None)) -> torch.Tensor:
        """Gradient of ``sum(span(hidden) * grad_output)`` w.r.t. ``hidden`` (recomputes the forward)."""
        with torch.enable_grad():
            x0 = hidden.to(self.device, self.dtype).detach().requires_grad_(True)
            x = x0
            for block in self.blocks[blocks]:
                x = block(x, 0, None)
            (grad,) = torch.autograd.grad(x, x0, grad_output.to(self.device, self.dtype))
        return grad
