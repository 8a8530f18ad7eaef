"""``RemoteSequential``: the model's transformer blocks, hosted by the swarm, as a torch module.

Forward runs statelessly over a route (``rpc_forward`` per hop) and is differentiable: backward sends
the output gradient back hop by hop (``rpc_backward``), so prompt tuning and local heads train through it.
Slicing (``blocks[2:5]``) gives a RemoteSequential over those blocks only.

Deep prompts (Petals' semantics): ``forward(hidden, prompts)`` with ``prompts [num_blocks, B or 1, P, H]`` has
each server add ``prompts[i]`` to the first ``P`` positions before block ``i``; each hop gets its slice, and
backward returns gradients for both. Activations travel in each server's announced dtype (it would cast them
on arrival anyway), so a bfloat16 server halves the bytes on the wire without changing any result.
"""

from __future__ import annotations

import asyncio
import time

import torch
from torch import nn

from swarm_client import runtime
from swarm_client.errors import InvalidInputError, NoRouteError, PeerError, RemoteError
from swarm_client.lora import adapter_field, check_adapter_name
from swarm_client.peer_calls import call_stream
from swarm_client.routing import LOCAL_PEER, RouteHop
from swarm_client.sequence_manager import SequenceManager
from swarm_client.session import CALLER_ERRORS, InferenceSession

#: one hop of a stateless forward: the hop, its input and its slice of the deep prompts (if any)
TraceItem = tuple[RouteHop, torch.Tensor, "torch.Tensor | None"]


def _wire_dtype(manager: SequenceManager, peer_id: str) -> torch.dtype | None:
    """The dtype ``peer_id`` computes in (from its DHT record), or None when unknown."""
    span = manager.spans.get(peer_id)
    dtype = getattr(torch, span.server_info.dtype, None) if span is not None else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _to_wire(tensor: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return tensor if tensor is None or dtype is None else tensor.to(dtype)


async def _run_span(
    manager: SequenceManager,
    start: int,
    end: int,
    hidden: torch.Tensor,
    output_hidden_states: bool = False,
    prompts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[TraceItem], list[torch.Tensor]]:
    """Forward ``hidden`` through blocks ``[start, end)``, re-routing around failing servers.

    ``prompts`` (``[end - start, B or 1, P, H]``) are deep prompts; each hop is sent its slice.
    """
    deadline = time.monotonic() + manager.config.failover_deadline
    position, x = start, hidden
    trace: list[TraceItem] = []
    states: list[torch.Tensor] = []
    adapter = manager.config.active_adapter
    while position < end:
        try:
            hops = await manager.make_route(position, end, adapter=adapter)
        except NoRouteError:
            if time.monotonic() + 0.5 > deadline:
                raise
            await asyncio.sleep(0.5)
            continue
        for hop in hops:
            local = manager.local if hop.peer_id == LOCAL_PEER else None
            dtype = None if local is not None else _wire_dtype(manager, hop.peer_id)
            x = _to_wire(x, dtype)
            hop_prompts = _to_wire(None if prompts is None else prompts[hop.start - start : hop.end - start], dtype)
            if local is not None:  # the client's own blocks (``local_span``): in place, they never fail over
                out = await local.run(local.forward, x, output_hidden_states, hop.start, hop.end, hop_prompts)
                trace.append((hop, x, hop_prompts))
                states.extend(out.unbind(0) if output_hidden_states else ())
                x, position = (out[-1] if output_hidden_states else out), hop.end
                continue
            try:
                t0 = time.perf_counter()
                outputs = await call_stream(
                    manager,
                    hop.peer_id,
                    "rpc_forward",
                    [x] if hop_prompts is None else [x, hop_prompts],
                    output_hidden_states=output_hidden_states,
                    start_block=hop.start,
                    end_block=hop.end,
                    **adapter_field(adapter),
                )
                if len(outputs) != 1:
                    raise PeerError(f"{hop.peer_id} sent {len(outputs)} tensors, not 1", hop.peer_id)
                (out,) = outputs
                expected = (hop.end - hop.start, *x.shape) if output_hidden_states else tuple(x.shape)
                if tuple(out.shape) != expected or not torch.isfinite(out).all():
                    raise PeerError(
                        f"server {hop.peer_id} returned invalid activations {tuple(out.shape)}", hop.peer_id
                    )
                manager.record_step(hop.peer_id, hop.end - hop.start, x.shape[1], time.perf_counter() - t0)
            except CALLER_ERRORS:
                raise
            except (PeerError, RemoteError) as e:
                manager.fault(hop.peer_id, e)
                if time.monotonic() > deadline:
                    raise
                break  # re-route from `position`
            trace.append((hop, x, hop_prompts))
            if output_hidden_states:
                states.extend(out.unbind(0))
                x = out[-1]
            else:
                x = out
            position = hop.end
    return x, trace, states


#: gradient w.r.t. the deep prompts of blocks ``[start, end)``
PromptGrad = tuple[int, int, torch.Tensor]


async def _backward_trace(
    manager: SequenceManager, trace: list[TraceItem], grad: torch.Tensor
) -> tuple[torch.Tensor, list[PromptGrad]]:
    """Gradient w.r.t. the trace's input, and the prompts' gradients per hop (absolute block indices)."""
    prompt_grads: list[PromptGrad] = []
    for hop, inputs, prompts in reversed(trace):
        grad = _to_wire(grad, inputs.dtype)
        if hop.peer_id == LOCAL_PEER:
            local = manager.local
            grads = await local.run(local.backward, inputs, grad, hop.start, hop.end, prompts)
            if prompts is not None:
                prompt_grads.append((hop.start, hop.end, grads[1]))
            grad = grads[0]
            continue
        try:
            grads = await call_stream(
                manager,
                hop.peer_id,
                "rpc_backward",
                [inputs, grad] if prompts is None else [inputs, grad, prompts],
                start_block=hop.start,
                end_block=hop.end,
                **adapter_field(manager.config.active_adapter),
            )
            if len(grads) != (1 if prompts is None else 2) or grads[0].shape != inputs.shape:
                raise PeerError(f"server {hop.peer_id} returned invalid gradients", hop.peer_id)
            if prompts is not None:
                if grads[1].shape != prompts.shape:
                    raise PeerError(f"server {hop.peer_id} returned invalid prompt gradients", hop.peer_id)
                prompt_grads.append((hop.start, hop.end, grads[1]))
            grad = grads[0]
        except CALLER_ERRORS:
            raise
        except (PeerError, RemoteError) as e:
            # the server that ran the forward is gone: recompute this hop's backward on another route
            manager.fault(hop.peer_id, e)
            _, sub_trace, _ = await _run_span(manager, hop.start, hop.end, inputs, prompts=prompts)
            grad, sub_grads = await _backward_trace(manager, sub_trace, grad)
            prompt_grads.extend(sub_grads)
    return grad, prompt_grads


class _RemoteForward(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None,
        manager: SequenceManager,
        start: int,
        end: int,
        *local_params: torch.Tensor,
    ) -> torch.Tensor:
        """``local_params``: trainable parameters of the client's local blocks in ``[start, end)``, inputs only so
        that autograd calls ``backward`` even when nothing before the blocks trains (``LocalSpan.backward``
        accumulates their gradients itself)."""
        ctx.num_local_params = len(local_params)
        wire_prompts = None if prompts is None else prompts.detach().cpu()
        out, trace, _ = runtime.run(_run_span(manager, start, end, hidden.detach().cpu(), prompts=wire_prompts))
        ctx.manager, ctx.trace, ctx.start = manager, trace, start
        ctx.hidden_meta = (hidden.device, hidden.dtype)
        ctx.prompts_meta = None if prompts is None else (prompts.shape, prompts.device, prompts.dtype)
        return out.to(hidden.device, hidden.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad, pieces = runtime.run(_backward_trace(ctx.manager, ctx.trace, grad_output.detach().cpu().contiguous()))
        grad_prompts = None
        if ctx.prompts_meta is not None:
            shape, device, dtype = ctx.prompts_meta
            grad_prompts = torch.zeros(shape, dtype=dtype)
            for start, end, piece in pieces:
                grad_prompts[start - ctx.start : end - ctx.start] = piece.to(dtype)
            grad_prompts = grad_prompts.to(device)
        device, dtype = ctx.hidden_meta
        return grad.to(device, dtype), grad_prompts, None, None, None, *([None] * ctx.num_local_params)


class RemoteSequential(nn.Module):
    def __init__(self, manager: SequenceManager, start: int = 0, end: int | None = None):
        super().__init__()
        self.manager = manager
        self.start = start
        self.end = manager.config.num_blocks if end is None else end

    def __len__(self) -> int:
        return self.end - self.start

    def __getitem__(self, index: int | slice) -> RemoteSequential:
        if isinstance(index, int):
            if index < 0:
                index += len(self)
            if not 0 <= index < len(self):
                raise IndexError(f"block {index} out of range for {len(self)} blocks")
            return RemoteSequential(self.manager, self.start + index, self.start + index + 1)
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise ValueError("remote blocks can only be sliced contiguously (step 1)")
        return RemoteSequential(self.manager, self.start + start, self.start + max(start, stop))

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def _check(self, hidden: torch.Tensor, prompts: torch.Tensor | None = None) -> None:
        if hidden.ndim != 3:
            raise InvalidInputError(f"expected hidden states [batch, tokens, hidden], got {tuple(hidden.shape)}")
        if prompts is None:
            return
        if (
            prompts.ndim != 4
            or prompts.shape[0] != len(self)
            or prompts.shape[1] not in (1, hidden.shape[0])
            or not 1 <= prompts.shape[2] <= hidden.shape[1]
            or prompts.shape[3] != hidden.shape[2]
        ):
            raise InvalidInputError(
                f"deep prompts must be [{len(self)} blocks, {hidden.shape[0]} or 1, prefix <= "
                f"{hidden.shape[1]}, {hidden.shape[2]}], got {tuple(prompts.shape)}"
            )

    def forward(self, hidden: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """Stateless forward through these blocks, differentiable w.r.t. ``hidden`` and the deep ``prompts``.

        ``prompts[i]`` ``[B or 1, P, H]`` is added to the first ``P`` positions of the hidden states before
        block ``i`` of this slice (Petals' deep prompt tuning).
        """
        self._check(hidden, prompts)
        if len(self) == 0:
            return hidden
        return _RemoteForward.apply(hidden, prompts, self.manager, self.start, self.end, *self._local_trainables())

    def _local_trainables(self) -> list[torch.Tensor]:
        """Trainable parameters of the client's local blocks inside this slice (e.g. LoRA put there with PEFT)."""
        local = self.manager.local
        if local is None or not torch.is_grad_enabled() or local.end <= self.start or self.end <= local.start:
            return []
        blocks = local.blocks[max(self.start, local.start) - local.start : min(self.end, local.end) - local.start]
        return [param for block in blocks for param in block.parameters() if param.requires_grad]

    def forward_with_states(
        self, hidden: torch.Tensor, prompts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Output and every block's output (no autograd)."""
        self._check(hidden, prompts)
        wire_prompts = None if prompts is None else prompts.detach().cpu()
        out, _, states = runtime.run(
            _run_span(self.manager, self.start, self.end, hidden.detach().cpu(), True, prompts=wire_prompts)
        )
        device, dtype = hidden.device, hidden.dtype
        return out.to(device, dtype), [s.to(device, dtype) for s in states]

    def inference_session(
        self,
        max_length: int,
        batch_size: int = 1,
        session_id: str | None = None,
        keep_on_close: bool = False,
        adapter: str | None = None,
    ) -> InferenceSession:
        """A KV-cached session over these blocks; ``adapter``: the served LoRA adapter it runs with (default:
        ``ClientConfig.active_adapter``)."""
        adapter = check_adapter_name(adapter) if adapter is not None else self.manager.config.active_adapter
        return InferenceSession(
            self.manager, self.start, self.end, max_length, batch_size, session_id, keep_on_close, adapter
        )

    def extra_repr(self) -> str:
        return f"blocks {self.start}:{self.end} of {self.manager.config.dht_prefix}"
