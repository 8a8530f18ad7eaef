"""Inference streams: one session per stream, its KV cache, and each step through the batcher.

The first message opens (or resumes) a session; every later one is a step, a ``close``, or nothing for
``idle_timeout`` seconds (less while the cache is nearly full: ``CacheManager.idle_limit``). The session's
tokens count against the caller's address (``worker.cache_policy``); a session evicted for another peer's
room answers its next step with ``SessionEvictedError`` and the stream ends.
Steps arrive from the client and, pushed by the previous server of the chain
(``worker.push``), through the stream's inbox; a step's second copy (same ``step_id``) is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from typing import AsyncIterator  # noqa: UP035 - hivemind detects streams by typing.AsyncIterator only

import torch
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from swarm_client import protocol
from swarm_client.capabilities import is_count, push_key, token_digest
from swarm_client.errors import InvalidInputError, LengthExceededError, RemoteError, SessionEvictedError
from swarm_client.protocol import MAX_PIPELINE_GROUPS
from worker.batcher import StepBatcher
from worker.cache import CacheManager, SessionCache
from worker.cache_policy import holder_of
from worker.compute import StepItem
from worker.dial_policy import observed_ips
from worker.metrics import WorkerMetrics
from worker.push import PushStream, ServerPush
from worker.wire import internal_error

logger = logging.getLogger(__name__)
#: how many recent step ids a stream remembers to drop the second copy of a step (push + client copy)
_REMEMBERED_STEPS = 16
#: messages a session's inbox holds (client steps and pushed ones); a full inbox stops reading the client's
#: stream (backpressure down to the transport) and drops pushed steps (the client's own copy follows)
INBOX_SIZE = 8
#: how long each step of a ``--fault slow`` server is held
SLOW_FAULT_SECONDS = 0.25
#: how long finding the caller's address (the p2p daemon's peer list) may take before a session opens
HOLDER_LOOKUP_TIMEOUT = 1.0


class InferenceStreams(ServerPush):
    """``rpc_inference`` and the session steps behind it, mixed into ``BlockHandler``."""

    caches: CacheManager
    batcher: StepBatcher
    accepting: bool
    fault: str | None
    fault_after: int
    tokens_processed: int
    inference_steps: int
    active_streams: int
    metrics: WorkerMetrics | None
    pushes_used: int
    copies_after_push: int
    #: compute time of the latest step (set by ``_step``)
    last_step_seconds: float
    #: the p2p the RPCs are served on (set by ``HandlerSwitch``): where callers connect from
    p2p: P2P | None = None

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """One session's stream. Steps come from the client or, pushed by the previous server of the
        chain, through ``rpc_push``; both land in one inbox, and a step's second copy (same ``step_id``)
        is dropped, so the client gets exactly one answer per step, from whichever copy came first."""
        owner = context.remote_id.to_base58() if context.remote_id is not None else None
        holder = await self._holder(context.remote_id)
        cache: SessionCache | None = None
        keep = False
        inbox: asyncio.Queue = asyncio.Queue(INBOX_SIZE)
        pushes: dict[str, PushStream] = {}
        pump: asyncio.Task | None = None
        self.active_streams += 1
        try:
            try:
                first = await asyncio.wait_for(anext(requests), self.limits.idle_timeout)
                cache = self._open_session(self._unpack(first.metadata), owner, holder)
            except (RemoteError, ValueError) as e:
                yield protocol.make_response(error=self._wire_error(e))
                return
            except (TimeoutError, StopAsyncIteration):
                return
            # held before the answer goes out: the client may bundle the session's next step (``rpc_steps``)
            # the moment it reads the answer, and a bundle needs the stream to hold the session
            self._inboxes[cache.session_id] = inbox
            self.deliver_early(cache.session_id, inbox, cache.push_key)
            yield protocol.make_response(position=cache.position, session_id=cache.session_id, seq=cache.last_seq)
            pump = asyncio.create_task(self._pump(requests, inbox))
            recent: deque[str] = deque(maxlen=_REMEMBERED_STEPS)

            while True:
                wait = min(self.limits.idle_timeout, self.caches.pressure_idle_timeout)  # pressure may come
                try:
                    async with asyncio.timeout(wait):  # cheaper than wait_for per step
                        source, message = await inbox.get()
                except TimeoutError:
                    limit = wait if cache.evicted else self.caches.idle_limit(self.limits.idle_timeout)
                    if time.monotonic() - cache.last_used < limit:
                        continue  # kept busy by bundled steps (rpc_steps), which do not pass this stream
                    logger.info("session %s idle for %.0fs; closing it", cache.session_id, limit)
                    break
                if source == "end":
                    break
                if source == "push":
                    response = await self._pushed_step(cache, message, recent, pushes)
                    if response is not None:
                        yield response
                    continue
                step_id = None
                try:
                    metadata = self._unpack(message.metadata)
                    if "close" in metadata:
                        keep = bool(metadata["close"].get("keep", False))
                        break
                    step_id = metadata.get("step_id")
                    if step_id is not None and step_id in recent:
                        self.copies_after_push += 1
                        continue  # already answered from the pushed copy
                    tensors = self._deserialize(message.tensors, max_count=1)
                    if step_id is not None:
                        recent.append(step_id)
                    out, position = await self._step(cache, tensors, metadata)
                    self._push_next(out, metadata, pushes)
                    yield self._step_response(out, position, metadata)
                except (RemoteError, ValueError) as e:
                    yield protocol.make_response(error=self._wire_error(e), step_id=step_id)
                    if isinstance(e, SessionEvictedError):
                        break  # nothing left to step: the client re-opens elsewhere
                except Exception as e:  # never let one session take the server down
                    logger.exception("inference step failed")
                    yield protocol.make_response(error=internal_error(e), step_id=step_id)
        finally:
            self.active_streams -= 1
            if pump is not None:
                pump.cancel()
            for stream in pushes.values():
                stream.close()
            if cache is not None:
                if self._inboxes.get(cache.session_id) is inbox:
                    del self._inboxes[cache.session_id]
                if self.caches.sessions.get(cache.session_id) in (None, cache):  # an evicted id may be reused
                    self.batcher.forget(cache.session_id)
                self.caches.release(cache.session_id, keep=keep, cache=cache)

    async def _holder(self, peer: PeerID | None) -> str | None:
        """Whom the caller's tokens count against: its address, as the p2p daemon sees its connection."""
        if peer is None:
            return None
        observed = []
        if self.p2p is not None:
            with contextlib.suppress(Exception):  # no answer: count by peer id
                observed = await asyncio.wait_for(observed_ips(self.p2p, peer), HOLDER_LOOKUP_TIMEOUT)
        return holder_of(peer.to_base58(), observed)

    def _open_session(self, metadata: dict, owner: str | None, holder: str | None = None) -> SessionCache:
        spec = metadata.get("open")
        if not isinstance(spec, dict):
            raise InvalidInputError("the first message of an inference stream must be {'open': {...}}")
        if not self.accepting:
            raise RemoteError("server is shutting down; open the session elsewhere")
        session_id = str(spec.get("session_id") or uuid.uuid4().hex)
        if spec.get("resume"):
            wanted = spec.get("max_length")
            if wanted is not None and (not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 1):
                raise InvalidInputError(f"max_length must be a positive int, got {wanted!r}")
            token = spec.get("resume_token")
            cache = self.caches.resume(session_id, owner, max_length=wanted, resume_token=token, holder=holder)
            if spec.get("adapter") != cache.adapter:  # a resume names the session's adapter (absent: none)
                raise InvalidInputError(
                    f"session {session_id[:80]!r} runs with adapter {cache.adapter!r}, not {spec['adapter']!r}"
                )
            return cache
        adapter = self._adapter(spec)
        start, end = self._blocks(spec)
        batch_size, max_length = spec.get("batch_size", 1), spec.get("max_length")
        if not isinstance(batch_size, int) or not 1 <= batch_size <= self.limits.max_batch_size:
            raise InvalidInputError(
                f"batch_size must be an int in [1, {self.limits.max_batch_size}], got {batch_size!r}"
            )
        if not isinstance(max_length, int) or max_length < 1:
            raise InvalidInputError(f"max_length must be a positive int, got {max_length!r}")
        cache = self.caches.open(session_id, batch_size, max_length, owner=owner, num_layers=end - start, holder=holder)
        cache.blocks = self._relative(start, end)
        cache.adapter = adapter
        cache.resume_digest = token_digest(spec.get("resume_token"))
        cache.push_key = push_key(spec.get("push_token"))
        return cache

    async def _step(
        self, cache: SessionCache, tensors: list[torch.Tensor], metadata: dict, pushed: bool = False
    ) -> tuple[torch.Tensor, int]:
        """Run one step; ``pushed``: it came from the previous server of the chain, and runs only if its
        ``seq`` is newer than every step run here (a late push of a step since redone must not roll back
        the cache under the client's feet)."""
        (hidden,) = self._check_hidden(tensors)
        self._check_step_size(hidden)
        self._check_compression_out(metadata)
        if hidden.shape[0] != cache.batch_size:
            raise InvalidInputError(f"batch size {hidden.shape[0]} does not match the session's {cache.batch_size}")
        position = metadata.get("position", cache.position)
        if not isinstance(position, int) or not 0 <= position <= cache.position:
            raise InvalidInputError(f"position {position!r} must be an int in [0, {cache.position}] (cached tokens)")
        group = metadata.get("batch_group")
        if group is not None:
            if not isinstance(group, int) or isinstance(group, bool) or not 0 <= group < MAX_PIPELINE_GROUPS:
                raise InvalidInputError(f"batch_group must be an int in [0, {MAX_PIPELINE_GROUPS}), got {group!r}")
            cache.batch_group = group
        seq = metadata.get("seq")
        if seq is not None and not is_count(seq):
            raise InvalidInputError(f"seq must be a non-negative int, got {seq!r}")
        length = hidden.shape[1]
        if position + length > cache.max_length:
            raise LengthExceededError(
                f"step of {length} tokens at position {position} exceeds the session's max_length {cache.max_length}"
            )
        self.caches.check_not_evicted(cache)
        async with cache.lock:
            self.caches.check_not_evicted(cache)  # evicted while this step waited for the lock
            if pushed and (seq is None or seq <= cache.last_seq):
                raise InvalidInputError(f"a stale push (seq {seq!r}, the session ran {cache.last_seq})")
            if seq is not None:
                cache.last_seq = max(cache.last_seq, seq)
            cache.touch()
            cache.position = position  # rolls back when position < cached tokens
            self.caches.ensure_capacity(cache, position + length)
            t0 = time.perf_counter()
            out = await self.batcher.submit(
                StepItem(cache, hidden, position, bool(metadata.get("output_hidden_states")))
            )
            self.last_step_seconds = time.perf_counter() - t0
        self.tokens_processed += length * hidden.shape[0]
        self.inference_steps += 1
        if self.metrics is not None:
            self.metrics.observe_step("inference", self.last_step_seconds, length * hidden.shape[0])
        if self.fault is not None and self.inference_steps > self.fault_after:
            out = await self._inject_fault(out)
        return out, cache.position

    async def _pushed_step(
        self,
        cache: SessionCache,
        pushed: tuple[list[torch.Tensor], dict],
        recent: deque[str],
        pushes: dict[str, PushStream],
    ) -> runtime_pb2.ExpertResponse | None:
        """Run a step the previous server pushed. Any problem with it is silently dropped: the client's
        own copy of the step follows and is answered (or refused) the normal way."""
        tensors, metadata = pushed
        step_id = metadata.get("step_id")
        if not isinstance(step_id, str) or step_id in recent:
            return None
        try:
            out, position = await self._step(cache, tensors, metadata, pushed=True)
            recent.append(step_id)
            self.pushes_used += 1
            self._push_next(out, metadata, pushes)
            # the input's digest lets the client check the push against what the previous server answered it
            return self._step_response(out, position, metadata, input_digest=protocol.input_digest(tensors[0]))
        except Exception as e:  # whatever a pushed step holds, the session goes on: the client's copy follows
            logger.debug("dropped a pushed step of session %s: %r", cache.session_id, e)
            return None

    async def _inject_fault(self, out: torch.Tensor) -> torch.Tensor:
        """Misbehave on purpose (``--fault``) so clients' failover can be tested against a real process."""
        if self.fault == "nan":
            return torch.full_like(out, float("nan"))
        if self.fault == "wrong-shape":
            return out[..., :-1]
        if self.fault == "noise":  # finite, right shape, wrong values: only a spot check can tell
            return out + 0.5 * out.std() * torch.randn_like(out)
        if self.fault == "hang":
            await asyncio.Event().wait()
        if self.fault == "slow":  # right answers, far slower than announced (a Sybil's inflated throughput)
            await asyncio.sleep(SLOW_FAULT_SECONDS)
        return out

    @staticmethod
    async def _pump(requests: AsyncIterator[runtime_pb2.ExpertRequest], inbox: asyncio.Queue) -> None:
        """Move the client's messages into the stream's inbox (where pushed steps also arrive)."""
        try:
            async for request in requests:
                await inbox.put(("client", request))  # full: stop reading until the session catches up
        except Exception as e:  # a broken stream ends the session like a closed one
            logger.debug("inference stream broke: %r", e)
        await inbox.put(("end", None))

    @staticmethod
    def _step_response(out: torch.Tensor, position: int, metadata: dict, **extra) -> runtime_pb2.ExpertResponse:
        return protocol.make_response(
            [out],
            compression=metadata.get("compression_out", metadata.get("compression", "none")),
            position=position,
            step_id=metadata.get("step_id"),
            **extra,
        )
