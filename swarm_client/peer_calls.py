"""One stateless call to one server: a request stream of tensors in, the answer's tensors out.

``rpc_forward`` and ``rpc_backward`` of ``remote_sequential`` and the spot checks of ``failover`` go through
``call_stream``; a server that times out, fails or answers with an error is turned into a ``PeerError`` once, here.
"""

from __future__ import annotations

import asyncio

import torch
from hivemind.proto import runtime_pb2

from swarm_client import protocol
from swarm_client.errors import PeerError, PeerTimeout, error_from_wire
from swarm_client.sequence_manager import SequenceManager


async def call_stream(manager: SequenceManager, peer_id: str, method: str, tensors: list[torch.Tensor], **metadata):
    """The tensors ``peer_id`` answers to ``method`` (``rpc_forward``, ``rpc_backward``) on ``tensors``."""
    stub = await manager.stub(peer_id)
    messages = protocol.split_message(
        tensors,
        {**metadata, "compression": manager.config.compression},
        runtime_pb2.ExpertRequest,
        manager.config.compression,
    )

    async def requests():
        for m in messages:
            yield m

    async def call():
        stream = await getattr(stub, method)(requests())
        return await protocol.gather_message(stream)

    try:
        out, meta = await asyncio.wait_for(call(), manager.config.request_timeout)
    except TimeoutError as e:
        raise PeerTimeout(f"{method} on {peer_id} timed out", peer_id) from e
    except Exception as e:
        raise PeerError(f"{method} on {peer_id} failed: {e}", peer_id) from e
    if "error" in meta:
        raise error_from_wire(meta["error"], peer_id)
    return out
