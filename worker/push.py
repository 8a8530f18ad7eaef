"""Server-to-server push: a step's output sent straight on to the next server of the client's chain.

The client names the chain (``push_chain`` in a step's metadata); this server forwards its output to the
first server of it over a long-lived ``rpc_push`` stream, and the receiving server queues each pushed step
into its session's inbox, where ``worker.inference`` runs it unless the client's own copy came first.
Pushing only saves a hop: every failure here is counted and dropped, never answered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import AsyncIterator  # noqa: UP035 - hivemind detects streams by typing.AsyncIterator only

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from swarm_client import protocol
from swarm_client.capabilities import push_auth_matches
from swarm_client.errors import InvalidInputError, RemoteError, SessionAccessError
from worker.cache import CacheManager
from worker.early_pushes import EarlyPushes
from worker.wire import WireChecks

logger = logging.getLogger(__name__)
#: streams push messages to a peer until they end (set by the server, which owns the p2p daemon)
#: a pushed step's id is echoed back to the client: bounded like everything a stranger sends
MAX_STEP_ID_CHARS = 64
#: the longest session id a push may be held for before its session opens (the client's are ~60 chars)
MAX_SESSION_ID_CHARS = 256
PushSender = Callable[[str, AsyncIterator[runtime_pb2.ExpertRequest]], Awaitable[None]]


class ServerPush(WireChecks):
    """Sending and receiving pushed steps, mixed into ``BlockHandler``."""

    #: open inference streams' inboxes by session id (kept by ``worker.inference``)
    _inboxes: dict[str, asyncio.Queue]
    caches: CacheManager
    push_sender: PushSender | None
    pushes_sent: int
    push_failures: int
    pushes_refused: int
    pushes_dropped: int
    pushes_held: int
    early_pushes: EarlyPushes
    #: test-only fault injection (``--fault``), kept by ``BlockHandler``
    fault: str | None
    fault_after: int
    inference_steps: int

    def holds_stream(self, session_id: str) -> bool:
        """Whether an open inference stream here holds ``session_id`` (pushes and bundles need one)."""
        return session_id in self._inboxes

    async def rpc_push(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Steps pushed by a previous server of a chain (``serve_pushes``)."""
        async for response in serve_pushes(requests, [self]):
            yield response

    def accept_push(self, request: runtime_pb2.ExpertRequest, metadata: dict) -> bool:
        """Queue a pushed step into its session's inbox: False if that is full (pushes only save a hop, the
        client's own copy follows); a typed error if the step is malformed or lacks the client's authorization
        of this very step (``capabilities.push_auth``: knowing a session id, or having been asked to push
        another step, is not enough to steer it); ``metadata``: the request's, unpacked."""
        session_id, step_id = metadata.get("session_id"), metadata.get("step_id")
        if not isinstance(step_id, str) or len(step_id) > MAX_STEP_ID_CHARS:
            raise InvalidInputError(f"a pushed step needs a step_id string of at most {MAX_STEP_ID_CHARS} chars")
        inbox = self._inboxes.get(session_id) if isinstance(session_id, str) else None
        if inbox is None and self._hold_early(request, metadata):
            return True
        cache = self.caches.sessions.get(session_id) if inbox is not None else None
        if cache is None or not push_auth_matches(cache.push_key, metadata):
            raise SessionAccessError(
                f"no open session {str(session_id)[:80]!r} here accepts this push: it needs the client's "
                "authorization of this step (push_auth over its step_id, position and seq)"
            )
        self._check_compression_out(metadata)
        tensors = self._deserialize(request.tensors, max_count=1)
        try:
            inbox.put_nowait(("push", (tensors, metadata)))
        except asyncio.QueueFull:
            self.pushes_dropped += 1
            return False
        return True

    def _hold_early(self, request: runtime_pb2.ExpertRequest, metadata: dict) -> bool:
        """Hold a push whose session is not open here (yet): its open may be a moment behind (``early_pushes``)."""
        session_id = metadata.get("session_id")
        if not isinstance(session_id, str) or len(session_id) > MAX_SESSION_ID_CHARS:
            return False
        if not isinstance(metadata.get("push_auth"), str) or session_id in self.caches.sessions:
            return False  # nothing to check later, or a session held by no stream here (kept for a resume)
        self._check_compression_out(metadata)
        if not self.early_pushes.hold(session_id, self._deserialize(request.tensors, max_count=1), metadata):
            return False
        self.pushes_held += 1
        return True

    def deliver_early(self, session_id: str, inbox: asyncio.Queue, push_key: str | None) -> None:
        """Queue the pushes held for a session that just opened, if the client authorized each of them."""
        for tensors, metadata in self.early_pushes.take(session_id):
            if not push_auth_matches(push_key, metadata):
                self.pushes_refused += 1
                continue
            try:
                inbox.put_nowait(("push", (tensors, metadata)))
            except asyncio.QueueFull:
                self.pushes_dropped += 1

    def _push_next(self, out: torch.Tensor, metadata: dict, pushes: dict[str, PushStream]) -> None:
        """Send this step's output straight to the next server of the chain, if the client asked.

        ``pushes``: this session's outgoing push streams by target session, opened on first use."""
        chain = metadata.get("push_chain")
        if not chain or self.push_sender is None or not isinstance(chain, list):
            return
        target = chain[0]
        if not isinstance(target, dict) or not isinstance(target.get("peer_id"), str):
            return
        session_id = str(target.get("session_id"))
        if self.fault == "push-noise" and self.inference_steps > self.fault_after:
            out = out + 0.5 * torch.randn_like(out)  # test-only (``--fault push-noise``): answer right, push wrong
        stream = pushes.get(session_id)
        if stream is None or stream.closed:
            for stale in pushes.values():  # the client re-routed: the old target is no longer in its chain
                stale.close()
            pushes.clear()
            stream = pushes[session_id] = PushStream(target["peer_id"], self.push_sender, self)
        stream.send(
            protocol.make_request(
                [out],
                compression=metadata.get("compression_out", "none"),
                session_id=session_id,
                push_auth=target.get("push_auth"),
                step_id=metadata.get("step_id"),
                position=metadata.get("position"),
                seq=metadata.get("seq"),
                push_chain=chain[1:],
                compression_out=metadata.get("compression_out", "none"),
            )
        )


async def serve_pushes(
    requests: AsyncIterator[runtime_pb2.ExpertRequest], handlers: Sequence[ServerPush]
) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    """Steps pushed by a previous server of a chain, one message each, over one long-lived stream; each goes
    into the inbox of its session, on whichever of ``handlers`` (current first, then retired ones still
    draining) holds it. A refused step is answered with its typed error at once (the pusher need not read
    them: unread answers stop this stream, nobody else's); the stream ends with a count of the accepted ones."""
    accepted = 0
    async for request in requests:
        handler = handlers[0]
        try:
            metadata = handler._unpack(request.metadata)
            session_id = metadata.get("session_id")
            handler = next((h for h in handlers if isinstance(session_id, str) and h.holds_stream(session_id)), handler)
            accepted += handler.accept_push(request, metadata)
        except (RemoteError, ValueError) as e:
            handler.pushes_refused += 1
            yield protocol.make_response(error=handler._wire_error(e))
    yield protocol.make_response(accepted=accepted)


class PushStream:
    """One long-lived stream to the next server of a chain, carrying a session's pushed steps.

    Opening a libp2p stream per step costs more than the hop a push saves, so a session keeps one
    stream per target and closes it when it ends. Failures only count: the client's own copy of every
    step still reaches the target.
    """

    def __init__(self, peer_id: str, sender: PushSender, handler: ServerPush):
        self.peer_id = peer_id
        self.handler = handler
        self._queue: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self._task = asyncio.create_task(self._run(sender))

    def send(self, request: runtime_pb2.ExpertRequest) -> None:
        self._queue.put_nowait(request)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put_nowait(None)

    async def _messages(self) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        while True:
            request = await self._queue.get()
            if request is None:
                return
            self.handler.pushes_sent += 1
            yield request

    async def _run(self, sender: PushSender) -> None:
        try:
            await sender(self.peer_id, self._messages())
        except Exception as e:
            self.handler.push_failures += 1
            logger.debug("push stream to %s failed: %r", self.peer_id, e)
        finally:
            self.closed = True
