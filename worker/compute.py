"""Running a span of blocks: with a session's KV cache, statelessly, and backward for fine-tuning."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from swarm_client.lora import adapter_rows
from worker.batched import (
    Segment,
    llama_forward_batch,
    rotary_tables,
    same_rotary,
    supports_batching,
)
from worker.cache import SessionCache


@dataclass
class StepItem:
    """One session's pending inference step."""

    cache: SessionCache
    hidden: torch.Tensor
    position: int
    output_hidden_states: bool = False


class SpanRunner:
    def __init__(self, blocks: list[nn.Module], dtype: torch.dtype, device: torch.device):
        self.blocks = blocks
        self.dtype = dtype
        self.device = device
        #: batches compute the rotary tables once for all layers when every block has the same rotary
        self.shared_rotary = bool(blocks) and all(supports_batching(b) for b in blocks) and same_rotary(blocks)

    @torch.inference_mode()
    def inference_step(
        self,
        cache: SessionCache,
        hidden: torch.Tensor,
        position: int,
        output_hidden_states: bool = False,
        blocks: slice = slice(None),
    ) -> torch.Tensor:
        """Run ``hidden`` [B, T, H] at ``position`` through ``blocks`` (relative to this span) with ``cache``
        (and the session's adapter)."""
        x = hidden.to(self.device, self.dtype)
        states = []
        with adapter_rows(cache.adapter):
            for block, kv in zip(self.blocks[blocks], cache.layer_kv(), strict=True):
                x = block(x, position, kv)
                if output_hidden_states:
                    states.append(x)
        cache.position = position + hidden.shape[1]
        return torch.stack(states) if output_hidden_states else x

    def can_batch(self, item: StepItem) -> bool:
        """Decode steps and prefills alike; steps that want every block's hidden states run alone."""
        return not item.output_hidden_states

    @torch.inference_mode()
    def inference_batch(self, items: list[StepItem]) -> list[torch.Tensor]:
        """Run several sessions' steps; steps over the same blocks share one pass (their tokens as rows).

        Results equal running each item alone with ``inference_step`` (same math per row; tests check it).
        """
        results: list[torch.Tensor | None] = [None] * len(items)
        groups: dict[tuple, list[int]] = {}
        for i, item in enumerate(items):
            blocks = item.cache.blocks
            batchable = self.can_batch(item) and all(supports_batching(b) for b in self.blocks[blocks])
            if batchable:
                groups.setdefault((blocks.start, blocks.stop), []).append(i)
            else:
                results[i] = self.inference_step(
                    item.cache, item.hidden, item.position, item.output_hidden_states, item.cache.blocks
                )
        for (start, stop), indices in groups.items():
            if len(indices) == 1:
                i = indices[0]
                results[i] = self.inference_step(
                    items[i].cache, items[i].hidden, items[i].position, False, slice(start, stop)
                )
                continue
            # every token of every step is a row: [sum of batch * length, 1, H]
            hidden = torch.cat(
                [items[i].hidden.to(self.device, self.dtype).reshape(-1, 1, items[i].hidden.shape[-1]) for i in indices]
            )
            # each step's rows [a, b) and its (batch, length)
            bounds, row = [], 0
            for i in indices:
                batch, length = items[i].hidden.shape[:2]
                bounds.append((row, row + batch * length, batch, length))
                row += batch * length
            rope = None
            # each row runs its own session's adapter (PEFT's mixed-batch LoRA, swarm_client/lora.py); no list
            # of rows when every session runs the base model
            names = [items[i].cache.adapter for i in indices]
            rows = [n for n, (a, b, *_) in zip(names, bounds, strict=True) for _ in range(a, b)] if any(names) else None
            with adapter_rows(rows):
                for layer_index, block in enumerate(self.blocks[slice(start, stop)]):
                    segments = [
                        Segment(a, b, items[i].position, items[i].cache.kv[layer_index], batch, length)
                        for i, (a, b, batch, length) in zip(indices, bounds, strict=True)
                    ]
                    if self.shared_rotary and rope is None:
                        rope = rotary_tables(block, hidden, segments)
                    hidden = llama_forward_batch(block, hidden, segments, rope)
            for i, (a, b, batch, length) in zip(indices, bounds, strict=True):
                items[i].cache.position = items[i].position + length
                results[i] = hidden[a:b].view(batch, length, -1)
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,
        output_hidden_states: bool = False,
        blocks: slice = slice(None),
        prompts: torch.Tensor | None = None,
        adapter: str | None = None,
    ) -> torch.Tensor:
        """Stateless forward; ``prompts[i]`` [B or 1, P, H] is added to positions [0, P) before block i."""
        x = hidden.to(self.device, self.dtype)
        prompts = None if prompts is None else prompts.to(self.device, self.dtype)
        states = []
        with adapter_rows(adapter):
            for i, block in enumerate(self.blocks[blocks]):
                if prompts is not None:
                    x = add_prompt(x, prompts[i])
                x = block(x, 0, None)
                if output_hidden_states:
                    states.append(x)
        return torch.stack(states) if output_hidden_states else x

    def backward(
        self,
        hidden: torch.Tensor,
        grad_output: torch.Tensor,
        blocks: slice = slice(None),
        prompts: torch.Tensor | None = None,
        adapter: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gradients of ``sum(span(hidden, prompts) * grad_output)`` w.r.t. ``hidden`` and ``prompts``.

        Recomputes the forward (the server keeps no activations between calls); the prompts' gradient is
        None when no prompts were given.
        """
        with torch.enable_grad(), adapter_rows(adapter):
            x0 = hidden.to(self.device, self.dtype).detach().requires_grad_(True)
            p = None if prompts is None else prompts.to(self.device, self.dtype).detach().requires_grad_(True)
            x = x0
            for i, block in enumerate(self.blocks[blocks]):
                if p is not None:
                    x = add_prompt(x, p[i])
                x = block(x, 0, None)
            inputs = (x0,) if p is None else (x0, p)
            grads = torch.autograd.grad(x, inputs, grad_output.to(self.device, self.dtype))
        return grads[0], (grads[1] if p is not None else None)


def add_prompt(hidden: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """``hidden`` [B, T, H] plus ``prompt`` [B or 1, P, H] on its first P positions (Petals' deep prompts).

    Out of place, so the same code serves the differentiable backward recomputation.
    """
    length = prompt.shape[1]
    return torch.cat([hidden[:, :length] + prompt, hidden[:, length:]], dim=1)
