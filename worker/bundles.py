"""Serving bundled steps (``rpc_steps``, see ``swarm_client.protocol`` and ``swarm_client.step_bundles``).

One stream per client carries the decode steps of all its sessions on this server. Each message's steps
are handed to whichever handler holds their session's own stream (the current span's, or a retired one
still draining after a rebalance), submitted to the batcher together, and answered in one message.
Bundles run concurrently and are answered as they finish, so a client's pipeline groups overlap here as
they do on separate streams.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import AsyncIterator  # noqa: UP035 - hivemind detects streams by typing.AsyncIterator only

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from swarm_client import protocol
from swarm_client.errors import (
    InvalidInputError,
    RemoteError,
    SessionEvictedError,
    SessionNotFoundError,
    error_to_wire,
)
from swarm_client.protocol import MAX_BUNDLE_STEPS, MAX_BUNDLES_IN_FLIGHT
from worker.inference import InferenceStreams
from worker.wire import internal_error, wire_error

logger = logging.getLogger(__name__)


class StepBundles(InferenceStreams):
    """``rpc_steps`` on one handler, and the per-step work a bundle hands to whichever handler holds the session;
    mixed into ``BlockHandler``."""

    async def rpc_steps(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Bundled steps of one client's sessions (``protocol``, ``serve_step_bundles``)."""
        async for response in serve_step_bundles(requests, context, lambda: [self]):
            yield response

    def parse_bundle(self, request: runtime_pb2.ExpertRequest) -> tuple[dict, list[dict], list[torch.Tensor]]:
        """A bundle's metadata, steps and hidden states, checked as any step's tensors are."""
        metadata = self._unpack(request.metadata)
        steps = metadata.get("steps")
        if not isinstance(steps, list) or not 1 <= len(steps) <= MAX_BUNDLE_STEPS:
            raise InvalidInputError(f"'steps' must be a list of 1 to {MAX_BUNDLE_STEPS} steps")
        if len(request.tensors) != len(steps) or not all(isinstance(step, dict) for step in steps):
            raise InvalidInputError(
                "a bundle needs one tensor and one dict per step; "
                f"got {len(request.tensors)} tensors for {len(steps)} steps"
            )
        return metadata, steps, self._deserialize(request.tensors, max_count=len(steps))

    async def bundled_step(
        self, step: dict, hidden: torch.Tensor, owner: str | None
    ) -> tuple[torch.Tensor | None, dict]:
        """One step of a bundle, on a session the same peer holds open here; its error stays its own."""
        try:
            session_id = step.get("session_id")
            cache = self.caches.sessions.get(session_id) if isinstance(session_id, str) else None
            if cache is None and session_id in self.caches.evicted_ids and self.holds_stream(session_id):
                raise SessionEvictedError(f"session {session_id[:80]!r} was evicted to make room; open it again")
            if cache is None or not self.holds_stream(session_id) or cache.owner != owner:
                raise SessionNotFoundError(
                    f"no open inference stream of yours holds session {str(session_id)[:80]!r} here; "
                    "open it with rpc_inference before bundling its steps"
                )
            out, position = await self._step(cache, [hidden], step)
            return out, {"position": position}
        except (RemoteError, ValueError) as e:
            return None, {"error": self._wire_error(e)}
        except Exception as e:  # never let one session take the server down
            logger.exception("bundled step failed")
            return None, {"error": internal_error(e)}


async def serve_step_bundles(
    requests: AsyncIterator[runtime_pb2.ExpertRequest],
    context: P2PContext,
    handlers: Callable[[], Sequence[StepBundles]],
) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    """Answer every bundle of one client's stream; ``handlers()``: the server's handlers, current first."""
    owner = context.remote_id.to_base58() if context.remote_id is not None else None
    answers: asyncio.Queue = asyncio.Queue()
    running: set[asyncio.Task] = set()

    async def answer(request: runtime_pb2.ExpertRequest) -> None:
        answers.put_nowait(await _run_bundle(request, owner, handlers()))

    async def read() -> None:
        try:
            async for request in requests:
                if len(running) >= MAX_BUNDLES_IN_FLIGHT:
                    error = InvalidInputError(f"more than {MAX_BUNDLES_IN_FLIGHT} bundles in flight; wait for answers")
                    answers.put_nowait(_bundle_error(request, error))
                    continue
                task = asyncio.create_task(answer(request))
                running.add(task)
                task.add_done_callback(running.discard)
        except Exception as e:  # a broken stream: finish what runs, then end
            logger.debug("step bundle stream broke: %r", e)
        await asyncio.gather(*running, return_exceptions=True)
        answers.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        while (response := await answers.get()) is not None:
            yield response
    finally:
        reader.cancel()
        for task in list(running):
            task.cancel()


def _bundle_error(request: runtime_pb2.ExpertRequest, error: Exception) -> runtime_pb2.ExpertResponse:
    try:
        bundle_id = protocol.unpack_metadata(request.metadata).get("bundle_id")
    except Exception:
        bundle_id = None
    return protocol.make_response(error=wire_error(error), bundle_id=bundle_id)


async def _run_bundle(
    request: runtime_pb2.ExpertRequest, owner: str | None, handlers: Sequence[StepBundles]
) -> runtime_pb2.ExpertResponse:
    try:
        metadata, steps, tensors = handlers[0].parse_bundle(request)
    except (RemoteError, ValueError) as e:
        return _bundle_error(request, e)
    results = await asyncio.gather(*(_one_step(s, t, owner, handlers) for s, t in zip(steps, tensors, strict=True)))
    return protocol.make_response(
        [out for out, _ in results if out is not None],
        compression=metadata.get("compression_out", "none"),
        bundle_id=metadata.get("bundle_id"),
        steps=[answer for _, answer in results],
    )


async def _one_step(
    step: dict, hidden: torch.Tensor, owner: str | None, handlers: Sequence[StepBundles]
) -> tuple[torch.Tensor | None, dict]:
    session_id = step.get("session_id")
    handler = next((h for h in handlers if isinstance(session_id, str) and h.holds_stream(session_id)), None)
    if handler is None:
        error = SessionNotFoundError(
            f"no open inference stream holds session {str(session_id)[:80]!r} here; "
            "open it with rpc_inference before bundling its steps"
        )
        return None, {"error": error_to_wire(error)}
    return await handler.bundled_step(step, hidden, owner)
