"""Bundled steps: the decode steps of all of a client's sessions on one server, one message per hop.

With N concurrent sessions each step costs N messages per hop each way, and every message pays for
protobuf, two p2p daemons and a wake-up of an asyncio task on both sides; on a CPU-bound client process that
handling, not the servers' batched compute, is what limits throughput. A ``StepBundler`` owns one
long-lived ``rpc_steps`` stream per server (``protocol``): steps submitted in the same event-loop
iteration travel as one message, the server batches them together and answers in one message, and each
answer is delivered to its session's inbox as if it had come over the session's own stream — so the
session's timeouts, liveness probes and failover (``_ServerSession``) stay exactly as they are.

Steps submitted in one iteration happen naturally: one bundled answer wakes all its sessions at once, and
each goes straight on to its next hop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from hivemind.proto import runtime_pb2

from swarm_client import protocol
from swarm_client.client_config import ClientConfig
from swarm_client.errors import PeerError

logger = logging.getLogger(__name__)

#: event-loop iterations a bundle waits for more steps after the last one came, and its longest wait
GATHER_PASSES = 3
GATHER_SECONDS = 0.001
#: an answer as a session's inbox holds it: the serialized output tensors and the step's metadata
Answer = tuple[list[runtime_pb2.Tensor], dict]


class Dialer(Protocol):
    """What a bundler needs of its client (a ``SequenceManager``): its settings and a stub to a server."""

    config: ClientConfig

    async def stub(self, peer_id: str) -> Any: ...


class StepBundler:
    """One client's ``rpc_steps`` stream to one server, opened on first use and reopened after a failure."""

    def __init__(self, manager: Dialer, peer_id: str):
        self.manager = manager
        self.peer_id = peer_id
        #: steps waiting for the next message: (inbox of the session, serialized hidden, step metadata)
        self._pending: list[tuple[asyncio.Queue, runtime_pb2.Tensor, dict]] = []
        #: bundles sent and not yet answered: bundle id → the inboxes of its steps, in order
        self._in_flight: dict[int, list[asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._requests: asyncio.Queue | None = None
        self._reader: asyncio.Task | None = None
        self._flush_task: asyncio.Task | None = None
        self.bundles_sent = 0
        self.steps_sent = 0

    def submit(self, inbox: asyncio.Queue, hidden: runtime_pb2.Tensor, step: dict) -> None:
        """Queue one step; its answer (or the exception that lost it) arrives in ``inbox``."""
        self._pending.append((inbox, hidden, step))
        if self._flush_task is None:
            self._flush_task = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        try:
            await self._gather()
            try:
                await self._ensure_open()
            except Exception as e:
                error = PeerError(f"could not open a step bundle stream to {self.peer_id}: {e}", self.peer_id)
                pending, self._pending = self._pending, []
                for inbox, _, _ in pending:
                    inbox.put_nowait(error)
                return
            while self._pending:
                bundle, size = [], 0
                while self._pending and len(bundle) < protocol.MAX_BUNDLE_STEPS:
                    size += len(self._pending[0][1].buffer)
                    if bundle and size > protocol.MAX_STEP_BYTES:
                        break
                    bundle.append(self._pending.pop(0))
                self._send(bundle)
        finally:
            self._flush_task = None

    async def _gather(self) -> None:
        """Let the steps that are on their way join: yield to the loop while each pass brings more steps
        (answers arriving together wake their sessions over a few iterations), for at most ``GATHER_SECONDS``."""
        deadline = time.monotonic() + GATHER_SECONDS
        seen = -1
        while len(self._pending) != seen and time.monotonic() < deadline:
            seen = len(self._pending)
            for _ in range(GATHER_PASSES):
                await asyncio.sleep(0)

    def _send(self, bundle: list[tuple[asyncio.Queue, runtime_pb2.Tensor, dict]]) -> None:
        bundle_id = next(self._ids)
        self._in_flight[bundle_id] = [inbox for inbox, _, _ in bundle]
        metadata = {
            "bundle_id": bundle_id,
            "steps": [step for _, _, step in bundle],
            "compression_out": self.manager.config.compression,
        }
        assert self._requests is not None
        self._requests.put_nowait(
            runtime_pb2.ExpertRequest(tensors=[t for _, t, _ in bundle], metadata=protocol.pack_metadata(metadata))
        )
        self.bundles_sent += 1
        self.steps_sent += len(bundle)

    async def _ensure_open(self) -> None:
        if self._requests is not None:
            return
        requests: asyncio.Queue = asyncio.Queue()
        stub = await self.manager.stub(self.peer_id)
        responses = await asyncio.wait_for(
            stub.rpc_steps(_drain(requests)), self.manager.config.connect_timeout
        )
        self._requests = requests
        self._reader = asyncio.create_task(self._read(responses, requests))

    async def _read(self, responses: AsyncIterator[runtime_pb2.ExpertResponse], requests: asyncio.Queue) -> None:
        error: Exception = PeerError(f"server {self.peer_id} closed the step bundle stream", self.peer_id)
        try:
            async for response in responses:
                self._deliver(response)
        except Exception as e:
            error = PeerError(f"server {self.peer_id} step bundle stream failed: {e}", self.peer_id)
        # the stream is gone: every step still in flight on it is lost; the next step opens a new one
        if self._requests is requests:
            self._requests = None
        in_flight, self._in_flight = self._in_flight, {}
        for inboxes in in_flight.values():
            for inbox in inboxes:
                inbox.put_nowait(error)
        requests.put_nowait(None)

    def _deliver(self, response: runtime_pb2.ExpertResponse) -> None:
        metadata = protocol.unpack_metadata(response.metadata)
        inboxes = self._in_flight.pop(metadata.get("bundle_id"), None)
        if inboxes is None:
            logger.debug("answer to an unknown bundle %r from %s", metadata.get("bundle_id"), self.peer_id)
            return
        steps = metadata.get("steps")
        if "error" in metadata or not isinstance(steps, list) or len(steps) != len(inboxes):
            answer = {"error": metadata.get("error") or {"code": "remote_error", "message": "malformed bundle answer"}}
            for inbox in inboxes:
                inbox.put_nowait(([], answer))
            return
        tensors = iter(response.tensors)
        for inbox, step in zip(inboxes, steps, strict=True):
            if not isinstance(step, dict) or "error" in step:
                inbox.put_nowait(([], step if isinstance(step, dict) else {"error": {"code": "remote_error"}}))
            else:
                inbox.put_nowait((list(itertools.islice(tensors, 1)), step))

    async def close(self) -> None:
        if self._requests is not None:
            self._requests.put_nowait(None)
            self._requests = None
        if self._reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), 2.0)
            except Exception:
                self._reader.cancel()


async def _drain(requests: asyncio.Queue) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    while (request := await requests.get()) is not None:
        yield request
