"""``RemoteSequential``: the model's transformer blocks, hosted by the swarm, as a torch module.

Forward runs statelessly over a route (``rpc_forward`` per hop) and is differentiable: backward sends
the output gradient back hop by hop (``rpc_backward``), so prompt tuning and local heads train through it.
Slicing (``blocks[2:5]``) gives a RemoteSequential over those blocks only.
"""

from __future__ import annotations

import asyncio
import time

import torch
from hivemind.proto import runtime_pb2
from torch import nn

from swarm_client import protocol, runtime
from swarm_client.errors import InvalidInputError, NoRouteError, PeerError, PeerTimeout, RemoteError, error_from_wire
from swarm_client.routing import RouteHop
from swarm_client.sequence_manager import SequenceManager
from swarm_client.session import CALLER_ERRORS, InferenceSession


async def _call_stream(manager: SequenceManager, peer_id: str, method: str, tensors: list[torch.Tensor], **metadata):
    stub = await manager.stub(peer_id)
    messages = protocol.split_message(
        tensors, {**metadata, "compression": manager.config.compression}, runtime_pb2.ExpertRequest, manager.config.compression
    )

    async def requests():
        for m in messages:
            yield m

    async def call():
        stream = await getattr(stub, method)(requests())
        return await protocol.gather_message(stream)

    try:
        out, meta = await asyncio.wait_for(call(), manager.config.request_timeout)
    except asyncio.TimeoutError as e:
        raise PeerTimeout(f"{method} on {peer_id} timed out", peer_id) from e
    except Exception as e:
        raise PeerError(f"{method} on {peer_id} failed: {e}", peer_id) from e
    if "error" in meta:
        raise error_from_wire(meta["error"], peer_id)
    return out


async def _run_span(
    manager: SequenceManager,
    start: int,
    end: int,
    hidden: torch.Tensor,
    output_hidden_states: bool = False,
) -> tuple[torch.Tensor, list[tuple[RouteHop, torch.Tensor]], list[torch.Tensor]]:
    """Forward ``hidden`` through blocks ``[start, end)``, re-routing around failing servers."""
    deadline = time.monotonic() + manager.config.failover_deadline
    position, x = start, hidden
    trace: list[tuple[RouteHop, torch.Tensor]] = []
    states: list[torch.Tensor] = []
    while position < end:
        try:
            hops = await manager.make_route(position, end)
        except NoRouteError:
            if time.monotonic() + 0.5 > deadline:
                raise
            await asyncio.sleep(0.5)
            continue
        for hop in hops:
            try:
                (out,) = await _call_stream(
                    manager,
                    hop.peer_id,
                    "rpc_forward",
                    [x],
                    output_hidden_states=output_hidden_states,
                    start_block=hop.start,
                    end_block=hop.end,
                )
                expected = (hop.end - hop.start, *x.shape) if output_hidden_states else tuple(x.shape)
                if tuple(out.shape) != expected or not torch.isfinite(out).all():
                    raise PeerError(f"server {hop.peer_id} returned invalid activations {tuple(out.shape)}", hop.peer_id)
            except CALLER_ERRORS:
                raise
            except (PeerError, RemoteError) as e:
                manager.ban(hop.peer_id, str(e))
                if time.monotonic() > deadline:
                    raise
                break  # re-route from `position`
            trace.append((hop, x))
            if output_hidden_states:
                states.extend(out.unbind(0))
                x = out[-1]
            else:
                x = out
            position = hop.end
    return x, trace, states


async def _backward_trace(
    manager: SequenceManager, trace: list[tuple[RouteHop, torch.Tensor]], grad: torch.Tensor
) -> torch.Tensor:
    for hop, inputs in reversed(trace):
        try:
            (grad,) = await _call_stream(
                manager, hop.peer_id, "rpc_backward", [inputs, grad], start_block=hop.start, end_block=hop.end
            )
        except CALLER_ERRORS:
            raise
        except (PeerError, RemoteError) as e:
            # the server that ran the forward is gone: recompute this hop's backward on another route
            manager.ban(hop.peer_id, str(e))
            _, sub_trace, _ = await _run_span(manager, hop.start, hop.end, inputs)
            grad = await _backward_trace(manager, sub_trace, grad)
    return grad


class _RemoteForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, manager: SequenceManager, start: int, end: int) -> torch.Tensor:
        out, trace, _ = runtime.run(_run_span(manager, start, end, hidden.detach().cpu()))
        ctx.manager, ctx.trace = manager, trace
        return out.to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad = runtime.run(_backward_trace(ctx.manager, ctx.trace, grad_output.detach().cpu().contiguous()))
        return grad.to(grad_output.dtype), None, None, None


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

    def _check(self, hidden: torch.Tensor) -> None:
        if hidden.ndim != 3:
            raise InvalidInputError(f"expected hidden states [batch, tokens, hidden], got {tuple(hidden.shape)}")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Stateless, differentiable forward through these blocks."""
        self._check(hidden)
        if len(self) == 0:
            return hidden
        return _RemoteForward.apply(hidden, self.manager, self.start, self.end)

    def forward_with_states(self, hidden: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Output and every block's output (no autograd)."""
        self._check(hidden)
        out, _, states = runtime.run(_run_span(self.manager, self.start, self.end, hidden.detach().cpu(), True))
        return out.to(hidden.dtype), [s.to(hidden.dtype) for s in states]

    def inference_session(
        self, max_length: int, batch_size: int = 1, session_id: str | None = None, keep_on_close: bool = False
    ) -> InferenceSession:
        return InferenceSession(self.manager, self.start, self.end, max_length, batch_size, session_id, keep_on_close)

    def extra_repr(self) -> str:
        return f"blocks {self.start}:{self.end} of {self.manager.config.dht_prefix}"
