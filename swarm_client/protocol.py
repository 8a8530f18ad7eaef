"""Wire vocabulary shared by clients and block servers.

Every RPC carries hivemind's ``ExpertRequest``/``ExpertResponse``: a list of serialized tensors plus a
msgpack metadata dict. RPC names are fixed here (``BlockRPC``) so client stubs and server handlers agree
whatever their Python class names are.

Inference stream (``rpc_inference``), one bidirectional stream per server span:
    client → {"open": {"session_id", "max_length", "batch_size", "resume", "resume_token", "push_token",
                        "adapter"?}}                            (tokens: ``swarm_client.capabilities``;
                                                                resuming needs the resume token given at open;
                                                                adapter: a LoRA the server announces, else
                                                                ``adapter_not_found``; a resume names the same)
    server → {"position": p, "seq": q}                        (p: tokens already cached, 0 for a new one;
                                                                q: the newest step counter it ran, below)
    client → tensors [hidden [B, T, H]], {"position": p, "seq": n}  (p: where these tokens start; p < current
                                                                position rolls the cache back first; n: the
                                                                session's step counter, one more per step sent)
    server → tensors [hidden [B, T, H]], {"position": p + T}
    any server message may instead be {"error": {"code", "message"}} — see ``swarm_client.errors``.
    A step carries at most ``MAX_STEP_TOKENS`` tokens (batch × length); longer prefills are split.
    Optional server-to-server push: a step may carry {"step_id": s, "push_chain": [{"peer_id",
    "session_id", "push_auth"}, ...]} (the next hops); the server then also sends its output to the first
    of them (``rpc_push``: one long-lived stream per target session, a message per step: tensors [out],
    {"session_id", "push_auth", "step_id", "position", "seq", "push_chain": rest}). The target checks
    ``push_auth`` — the client's HMAC of (step_id, position, seq) under the push token the session was opened
    with, ``capabilities.push_auth`` — (else a ``session_access_denied`` error) and runs the step at once
    unless its seq is not newer than every step it ran for the session (a late push: dropped). The client sends
    a hop its own copy only when the pushed step's answer is late; a server answers each step_id once,
    echoing it in the response, so a client skips answers whose step_id is not the one it waits for.
Bundled steps (``rpc_steps``, servers announcing the ``step_bundles`` feature): one long-lived stream per
client and server carries the decode steps of all the client's sessions on that server, so N concurrent
sessions cost one message per hop each way instead of N:
    client → tensors [h_1, ..., h_n], {"bundle_id": b, "steps": [{"session_id", "position",
             "batch_group"?, "output_hidden_states"?}, ...], "compression_out"?}
    server → tensors [out_i for each step that succeeded, in order], {"bundle_id": b,
             "steps": [{"position": p_i + T_i} or {"error": {...}}, ...]}   (or {"bundle_id", "error"})
    Each session must be open on the server through its own ``rpc_inference`` stream, opened by the same
    peer; that stream still opens, rolls back, keeps alive and closes the session. Bundles run concurrently
    and are answered as they finish (match answers by ``bundle_id``).
Forward / backward (``rpc_forward`` / ``rpc_backward``) are stream → stream so large tensors are chunked; their
metadata may name an ``"adapter"`` as an open does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind detects streams by typing.AsyncIterator only

import torch
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from swarm_client import p2p_guard

# every process that speaks BlockRPC (clients, workers) reads unary answers with the guarded reader: hivemind's
# own dies on a cancel racing an answer and leaves every later unary call to time out (issue 35)
p2p_guard.install()

#: tensors above this many bytes are split into chunks inside streams
STREAM_CHUNK_BYTES = 2**20
#: the largest single inference-stream message the client sends; longer prefills are split into steps
MAX_STEP_BYTES = 2**21
#: the most tokens (batch × length) one inference step may carry: servers refuse more (one step holds the
#: compute thread, and every other session, for its whole duration), clients split prefills below it
MAX_STEP_TOKENS = 1024


def step_tokens(hidden: torch.Tensor) -> int:
    """How many positions of ``hidden [batch, length, hidden]`` one inference step may carry: within
    ``MAX_STEP_BYTES`` and ``MAX_STEP_TOKENS`` (batch × length), at least one. Every sender of a long input — a
    prefill, a failover's replay — steps it in pieces of this length."""
    batch = max(1, hidden.shape[0])
    position_bytes = max(1, hidden[0, 0].numel() * hidden.element_size() * batch)
    return max(1, min(MAX_STEP_BYTES // position_bytes, MAX_STEP_TOKENS // batch))


#: an inference step may carry ``batch_group`` (an int below this): the client's pipeline group, which servers
#: batch one at a time (``ClientConfig.pipeline_groups``, worker/batcher.py)
MAX_PIPELINE_GROUPS = 64
#: the most steps one ``rpc_steps`` message may carry, and the most bundles one stream may have in flight
MAX_BUNDLE_STEPS = 256
MAX_BUNDLES_IN_FLIGHT = 64
#: feature a server announces (``ServerInfo.features``) when it serves ``rpc_steps``
STEP_BUNDLES = "step_bundles"

COMPRESSIONS = {
    "none": runtime_pb2.CompressionType.NONE,
    "float16": runtime_pb2.CompressionType.FLOAT16,
}


def wire_dtype(span: Any) -> torch.dtype | None:
    """The floating dtype a server computes in, from its announced span (``span.server_info.dtype``), or
    None when unknown: activations are sent to it in that dtype, so they cross the wire in it."""
    name = getattr(getattr(span, "server_info", None), "dtype", None)
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def pack_metadata(metadata: dict[str, Any]) -> bytes:
    return MSGPackSerializer.dumps(metadata)


def unpack_metadata(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    value = MSGPackSerializer.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("metadata must be a msgpack map")
    return value


def input_digest(tensor: torch.Tensor) -> str:
    """A short fingerprint of a tensor's dtype, shape and bytes: a server answering a pushed step echoes the
    digest of the input it ran, and the client compares it with the previous server's answer."""
    flat = tensor.detach().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return hashlib.blake2b(f"{flat.dtype}{tuple(tensor.shape)}".encode() + data, digest_size=8).hexdigest()


def serialize(tensor: torch.Tensor, compression: str = "none") -> runtime_pb2.Tensor:
    """``compression`` applies to float32/float64; bfloat16 always travels as its own 2 bytes per value.

    (hivemind's FLOAT16 codec refuses bfloat16, and its default NONE path widens it to float32.)
    """
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return runtime_pb2.Tensor(
            compression=runtime_pb2.CompressionType.NONE,
            buffer=tensor.contiguous().view(torch.int16).numpy().tobytes(),
            size=tensor.shape,
            dtype="bfloat16",
            requires_grad=tensor.requires_grad,
        )
    if not tensor.is_floating_point():
        compression = "none"
    return serialize_torch_tensor(tensor, COMPRESSIONS[compression])


def deserialize(message: runtime_pb2.Tensor) -> torch.Tensor:
    return deserialize_torch_tensor(message)


def make_request(
    tensors: Sequence[torch.Tensor] = (), compression: str = "none", **metadata
) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(
        tensors=[serialize(t, compression) for t in tensors], metadata=pack_metadata(metadata)
    )


def make_response(
    tensors: Sequence[torch.Tensor] = (), compression: str = "none", **metadata
) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(
        tensors=[serialize(t, compression) for t in tensors], metadata=pack_metadata(metadata)
    )


def split_message(tensors: Sequence[torch.Tensor], metadata: dict, cls, compression: str = "none") -> Iterable:
    """Yield ``cls`` messages carrying ``tensors`` in chunks; metadata rides on the first one."""
    parts = [part for t in tensors for part in split_for_streaming(serialize(t, compression), STREAM_CHUNK_BYTES)]
    if not parts:
        yield cls(metadata=pack_metadata(metadata))
        return
    for i, part in enumerate(parts):
        yield cls(tensors=[part], metadata=pack_metadata(metadata) if i == 0 else b"")


async def gather_message(stream: AsyncIterator) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Inverse of ``split_message`` over a whole stream."""
    from hivemind.utils.streaming import combine_from_streaming

    metadata: dict[str, Any] | None = None
    tensors: list[torch.Tensor] = []
    parts: list[runtime_pb2.Tensor] = []
    async for message in stream:
        if metadata is None:
            metadata = unpack_metadata(message.metadata)
        for part in message.tensors:
            if part.dtype and parts:
                tensors.append(deserialize(combine_from_streaming(parts)))
                parts = []
            parts.append(part)
    if parts:
        tensors.append(deserialize(combine_from_streaming(parts)))
    return tensors, metadata or {}


class BlockRPC(ServicerBase):
    """RPC surface of a block server; the worker subclasses it, clients use ``BlockRPC.get_stub``."""

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        name = f"swarmserve.BlockRPC.{method_name}"
        return f"{namespace}::{name}" if namespace is not None else name

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        raise NotImplementedError

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # pragma: no cover

    async def rpc_push(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # pragma: no cover

    async def rpc_steps(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # pragma: no cover

    async def rpc_forward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # pragma: no cover

    async def rpc_backward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # pragma: no cover
