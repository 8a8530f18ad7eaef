"""RPC handlers of a block server: inference streams, stateless forward/backward, info.

Every request is validated before it touches a block; a bad request gets a structured error
(``swarm_client.errors``) and the server goes on serving everybody else.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator  # noqa: UP035 - hivemind detects streams by typing.AsyncIterator only

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming

from swarm_client import protocol
from swarm_client.errors import (
    InvalidInputError,
    LengthExceededError,
    RemoteError,
    SessionNotFoundError,
    error_to_wire,
)
from swarm_client.protocol import MAX_BUNDLE_STEPS, MAX_PIPELINE_GROUPS
from worker.batcher import StepBatcher
from worker.cache import CacheManager, SessionCache
from worker.compute import SpanRunner, StepItem
from worker.metrics import WorkerMetrics

logger = logging.getLogger(__name__)
#: after refusing a request, keep the stream open this long once the client has sent everything
REFUSAL_LINGER = 0.1

#: dtypes a tensor may arrive in (wire name → bytes per value once decoded); anything else is refused
WIRE_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
WIRE_MAX_NDIM = 4
_NONE, _FLOAT16 = runtime_pb2.CompressionType.NONE, runtime_pb2.CompressionType.FLOAT16
#: how many recent step ids a stream remembers to drop the second copy of a step (push + client copy)
_REMEMBERED_STEPS = 16
#: streams push messages to a peer until they end (set by the server, which owns the p2p daemon)
PushSender = Callable[[str, AsyncIterator[runtime_pb2.ExpertRequest]], Awaitable[None]]


class HandlerLimits:
    def __init__(
        self,
        max_batch_size: int = 64,
        max_forward_tokens: int = 16384,
        max_tensor_bytes: int = 256 * 2**20,
        idle_timeout: float = 300.0,
    ):
        self.max_batch_size = max_batch_size
        self.max_forward_tokens = max_forward_tokens
        self.max_tensor_bytes = max_tensor_bytes
        self.idle_timeout = idle_timeout


class BlockHandler(protocol.BlockRPC):
    def __init__(
        self,
        runner: SpanRunner,
        caches: CacheManager,
        hidden_size: int,
        start: int,
        end: int,
        info: Callable[[], dict],
        limits: HandlerLimits | None = None,
    ):
        self.runner = runner
        self.caches = caches
        self.hidden_size = hidden_size
        self.start, self.end = start, end
        self.info = info
        self.limits = limits or HandlerLimits()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.batcher = StepBatcher(runner, self.executor, single_stream=lambda: self.active_streams <= 1)
        self.accepting = True
        #: test-only fault injection: "nan", "hang" or "wrong-shape" after ``fault_after`` inference steps
        self.fault: str | None = None
        self.fault_after = 0
        self.tokens_processed = 0
        self.inference_steps = 0
        self.active_streams = 0
        #: the server's Prometheus metrics (worker/metrics.py), set by the server; None: not measured
        self.metrics: WorkerMetrics | None = None
        #: server-to-server push (see ``rpc_push``): open streams' inboxes by session id, and the sender
        self._inboxes: dict[str, asyncio.Queue] = {}
        self.push_sender: PushSender | None = None
        self.pushes_sent = 0
        self.push_failures = 0
        self.pushes_used = 0

    async def _compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # ---------------------------------------------------------------- validation
    def _check_wire_tensor(self, t: runtime_pb2.Tensor, complete: bool = True) -> None:
        """Judge a serialized tensor by its header and byte count alone, so a lying ``size`` or a huge
        buffer is refused before any memory is allocated for it (``complete``: the buffer is whole)."""
        if t.compression not in (_NONE, _FLOAT16):
            raise InvalidInputError(f"unsupported tensor compression {t.compression!r} (use none or float16)")
        itemsize = WIRE_DTYPES.get(t.dtype)
        if itemsize is None or (t.compression == _FLOAT16 and t.dtype == "bfloat16"):
            wanted = sorted(WIRE_DTYPES)
            raise InvalidInputError(f"unsupported tensor dtype {t.dtype[:32]!r}; expected one of {wanted}")
        shape = list(t.size)
        if not 1 <= len(shape) <= WIRE_MAX_NDIM:
            raise InvalidInputError(f"tensor of {len(shape)} dimensions; expected 1 to {WIRE_MAX_NDIM}")
        numel, limit = math.prod(shape), self.limits.max_tensor_bytes
        size = max(numel * itemsize, len(t.buffer))
        if size > limit:
            raise InvalidInputError(f"tensor of {size} bytes exceeds the server's limit of {limit}")
        if not complete:
            return
        if t.compression == _FLOAT16:
            expected = (2 * numel,)
        elif t.dtype == "bfloat16":
            expected = (2 * numel, 4 * numel)  # hivemind's legacy codec widens bfloat16 to float32
        else:
            expected = (itemsize * numel,)
        if len(t.buffer) not in expected:
            raise InvalidInputError(
                f"tensor buffer of {len(t.buffer)} bytes does not match shape {shape} of {t.dtype} "
                f"({expected[0]} bytes)"
            )

    def _deserialize(self, serialized: Sequence[runtime_pb2.Tensor], max_count: int) -> list[torch.Tensor]:
        """Checked ``protocol.deserialize``: whatever a peer sends ends in InvalidInputError, not a crash."""
        if len(serialized) > max_count:
            raise InvalidInputError(f"expected at most {max_count} tensor(s), got {len(serialized)}")
        tensors = []
        for t in serialized:
            self._check_wire_tensor(t)
            try:
                tensors.append(protocol.deserialize(t))
            except Exception as e:
                raise InvalidInputError(f"malformed tensor: {e}") from e
        return tensors

    @staticmethod
    def _unpack(raw: bytes) -> dict:
        try:
            return protocol.unpack_metadata(raw)
        except Exception as e:
            raise InvalidInputError(f"malformed metadata: {type(e).__name__}") from e

    async def _gather(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], max_count: int
    ) -> tuple[list[torch.Tensor], dict]:
        """Like ``protocol.gather_message``, but stops reading as soon as the request outgrows the limits."""
        metadata: dict | None = None
        done: list[runtime_pb2.Tensor] = []
        parts: list[runtime_pb2.Tensor] = []
        received, budget = 0, max_count * self.limits.max_tensor_bytes
        async for message in requests:
            if metadata is None:
                metadata = self._unpack(message.metadata)
            for part in message.tensors:
                if part.dtype:  # the first chunk of a tensor carries its header
                    if parts:
                        done.append(combine_from_streaming(parts))
                        parts = []
                    if len(done) >= max_count:
                        raise InvalidInputError(f"expected at most {max_count} tensor(s)")
                    self._check_wire_tensor(part, complete=False)
                received += len(part.buffer)
                if received > budget:
                    raise InvalidInputError(f"request of over {budget} bytes exceeds the server's limit")
                parts.append(part)
        if parts:
            done.append(combine_from_streaming(parts))
        return self._deserialize(done, max_count), metadata or {}

    def _check_hidden(self, tensors: list[torch.Tensor], count: int = 1) -> list[torch.Tensor]:
        if len(tensors) != count:
            raise InvalidInputError(f"expected {count} tensor(s), got {len(tensors)}")
        for t in tensors:
            if not t.dtype.is_floating_point:
                raise InvalidInputError(f"hidden states must be floating point, got {t.dtype}")
            if t.ndim != 3:
                raise InvalidInputError(
                    f"hidden states must be [batch, tokens, hidden], got shape {tuple(t.shape)}"
                )
            if t.shape[2] != self.hidden_size:
                raise InvalidInputError(
                    f"hidden size {t.shape[2]} does not match this model's {self.hidden_size}"
                )
            if t.shape[1] < 1 or t.shape[0] < 1:
                raise InvalidInputError(f"empty hidden states {tuple(t.shape)}")
            if t.numel() * t.element_size() > self.limits.max_tensor_bytes:
                raise InvalidInputError(
                    f"tensor of {t.numel() * t.element_size()} bytes exceeds the server's limit"
                )
            if not torch.isfinite(t).all():
                raise InvalidInputError("hidden states contain NaN or inf")
        return tensors

    def _blocks(self, metadata: dict) -> tuple[int, int]:
        """The absolute sub-span ``[start, end)`` a request asks for (default: the whole span)."""
        start = metadata.get("start_block", self.start)
        end = metadata.get("end_block", self.end)
        if not (isinstance(start, int) and isinstance(end, int) and self.start <= start < end <= self.end):
            raise InvalidInputError(
                f"blocks {start!r}:{end!r} are not within this server's span {self.start}:{self.end}"
            )
        return start, end

    def _relative(self, start: int, end: int) -> slice:
        return slice(start - self.start, end - self.start)

    # ---------------------------------------------------------------- info
    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        self.caches.expire()
        payload = {
            **self.info(),
            **self.caches.stats(),
            "tokens_processed": self.tokens_processed,
            "inference_steps": self.inference_steps,
            "active_streams": self.active_streams,
            **self.batcher.stats(),
            "pushes_sent": self.pushes_sent,
            "push_failures": self.push_failures,
            "pushes_used": self.pushes_used,
            "accepting": self.accepting,
        }
        return runtime_pb2.ExpertInfo(serialized_info=protocol.pack_metadata(payload))

    # ---------------------------------------------------------------- inference
    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """One session's stream. Steps come from the client or, pushed by the previous server of the
        chain, through ``rpc_push``; both land in one inbox, and a step's second copy (same ``step_id``)
        is dropped, so the client gets exactly one answer per step, from whichever copy came first."""
        owner = context.remote_id.to_base58() if context.remote_id is not None else None
        cache: SessionCache | None = None
        keep = False
        inbox: asyncio.Queue = asyncio.Queue()
        pushes: dict[str, PushStream] = {}
        pump: asyncio.Task | None = None
        self.active_streams += 1
        try:
            try:
                first = await asyncio.wait_for(anext(requests), self.limits.idle_timeout)
                cache = self._open_session(self._unpack(first.metadata), owner)
            except (RemoteError, ValueError) as e:
                yield protocol.make_response(error=self._wire_error(e))
                return
            except (TimeoutError, StopAsyncIteration):
                return
            yield protocol.make_response(position=cache.position, session_id=cache.session_id)
            pump = asyncio.create_task(self._pump(requests, inbox))
            self._inboxes[cache.session_id] = inbox
            recent: deque[str] = deque(maxlen=_REMEMBERED_STEPS)

            while True:
                try:
                    async with asyncio.timeout(self.limits.idle_timeout):  # cheaper than wait_for per step
                        source, message = await inbox.get()
                except TimeoutError:
                    if time.monotonic() - cache.last_used < self.limits.idle_timeout:
                        continue  # kept busy by bundled steps (rpc_steps), which do not pass this stream
                    logger.info(
                        "session %s idle for %.0fs; closing it", cache.session_id, self.limits.idle_timeout
                    )
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
                        continue  # already answered from the pushed copy
                    tensors = self._deserialize(message.tensors, max_count=1)
                    if step_id is not None:
                        recent.append(step_id)
                    out, position = await self._step(cache, tensors, metadata)
                    self._push_next(out, metadata, pushes)
                    yield self._step_response(out, position, metadata)
                except (RemoteError, ValueError) as e:
                    yield protocol.make_response(error=self._wire_error(e), step_id=step_id)
                except Exception as e:  # never let one session take the server down
                    logger.exception("inference step failed")
                    yield protocol.make_response(
                        error={"code": "remote_error", "message": f"internal error: {e!r}"}, step_id=step_id
                    )
        finally:
            self.active_streams -= 1
            if pump is not None:
                pump.cancel()
            for stream in pushes.values():
                stream.close()
            if cache is not None:
                if self._inboxes.get(cache.session_id) is inbox:
                    del self._inboxes[cache.session_id]
                self.batcher.forget(cache.session_id)
                self.caches.release(cache.session_id, keep=keep)

    async def rpc_steps(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Bundled steps of one client's sessions (``protocol``, worker/bundles.py)."""
        from worker.bundles import serve_step_bundles  # local import: that module imports this one

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
            return None, {"error": {"code": "remote_error", "message": f"internal error: {e!r}"}}

    @staticmethod
    async def _pump(requests: AsyncIterator[runtime_pb2.ExpertRequest], inbox: asyncio.Queue) -> None:
        """Move the client's messages into the stream's inbox (where pushed steps also arrive)."""
        try:
            async for request in requests:
                inbox.put_nowait(("client", request))
        except Exception as e:  # a broken stream ends the session like a closed one
            logger.debug("inference stream broke: %r", e)
        inbox.put_nowait(("end", None))

    @staticmethod
    def _step_response(out: torch.Tensor, position: int, metadata: dict) -> runtime_pb2.ExpertResponse:
        return protocol.make_response(
            [out],
            compression=metadata.get("compression_out", metadata.get("compression", "none")),
            position=position,
            step_id=metadata.get("step_id"),
        )

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
            out, position = await self._step(cache, tensors, metadata)
        except Exception as e:
            logger.debug("dropped a pushed step of session %s: %r", cache.session_id, e)
            return None
        recent.append(step_id)
        self.pushes_used += 1
        self._push_next(out, metadata, pushes)
        return self._step_response(out, position, metadata)

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
                step_id=metadata.get("step_id"),
                position=metadata.get("position"),
                push_chain=chain[1:],
                compression_out=metadata.get("compression_out", "none"),
            )
        )

    def holds_stream(self, session_id: str) -> bool:
        return session_id in self._inboxes

    def accept_push(self, request: runtime_pb2.ExpertRequest) -> bool:
        """Queue a pushed step into its session's stream; False if the session or the message is unusable."""
        try:
            metadata = self._unpack(request.metadata)
            inbox = self._inboxes.get(str(metadata.get("session_id")))
            if inbox is None or not isinstance(metadata.get("step_id"), str):
                return False
            tensors = self._deserialize(request.tensors, max_count=1)
        except (RemoteError, ValueError):
            return False
        inbox.put_nowait(("push", (tensors, metadata)))
        return True

    async def rpc_push(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Steps pushed by a previous server of a chain, one message each, over one long-lived stream;
        each goes into its session's inbox. Ends with a count of the accepted ones."""
        accepted = 0
        async for request in requests:
            accepted += self.accept_push(request)
        yield protocol.make_response(accepted=accepted)


    def _open_session(self, metadata: dict, owner: str | None) -> SessionCache:
        spec = metadata.get("open")
        if not isinstance(spec, dict):
            raise InvalidInputError("the first message of an inference stream must be {'open': {...}}")
        if not self.accepting:
            raise RemoteError("server is shutting down; open the session elsewhere")
        session_id = str(spec.get("session_id") or uuid.uuid4().hex)
        if spec.get("resume"):
            return self.caches.resume(session_id, owner)
        start, end = self._blocks(spec)
        batch_size, max_length = spec.get("batch_size", 1), spec.get("max_length")
        if not isinstance(batch_size, int) or not 1 <= batch_size <= self.limits.max_batch_size:
            raise InvalidInputError(
                f"batch_size must be an int in [1, {self.limits.max_batch_size}], got {batch_size!r}"
            )
        if not isinstance(max_length, int) or max_length < 1:
            raise InvalidInputError(f"max_length must be a positive int, got {max_length!r}")
        cache = self.caches.open(session_id, batch_size, max_length, owner=owner, num_layers=end - start)
        cache.blocks = self._relative(start, end)
        return cache

    async def _step(
        self, cache: SessionCache, tensors: list[torch.Tensor], metadata: dict
    ) -> tuple[torch.Tensor, int]:
        (hidden,) = self._check_hidden(tensors)
        if hidden.shape[0] != cache.batch_size:
            raise InvalidInputError(
                f"batch size {hidden.shape[0]} does not match the session's {cache.batch_size}"
            )
        position = metadata.get("position", cache.position)
        if not isinstance(position, int) or not 0 <= position <= cache.position:
            raise InvalidInputError(
                f"position {position!r} must be an int in [0, {cache.position}] (cached tokens)"
            )
        group = metadata.get("batch_group")
        if group is not None:
            if not isinstance(group, int) or isinstance(group, bool) or not 0 <= group < MAX_PIPELINE_GROUPS:
                raise InvalidInputError(f"batch_group must be an int in [0, {MAX_PIPELINE_GROUPS}), got {group!r}")
            cache.batch_group = group
        length = hidden.shape[1]
        if position + length > cache.max_length:
            raise LengthExceededError(
                f"step of {length} tokens at position {position} exceeds the session's max_length {cache.max_length}"
            )
        async with cache.lock:
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
        return out

    # ---------------------------------------------------------------- forward / backward
    async def rpc_forward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """``[hidden]`` or ``[hidden, prompts]`` → ``[out]`` (``[N, B, T, H]`` with output_hidden_states)."""
        try:
            tensors, metadata = await self._gather(requests, max_count=2)
            if len(tensors) not in (1, 2):
                raise InvalidInputError(f"expected [hidden] or [hidden, prompts], got {len(tensors)} tensors")
            (hidden,) = self._check_hidden(tensors[:1])
            self._check_forward_size(hidden)
            start, end = self._blocks(metadata)
            prompts = self._check_prompts(tensors[1], hidden, end - start) if len(tensors) == 2 else None
            t0 = time.perf_counter()
            out = await self._compute(
                self.runner.forward,
                hidden,
                bool(metadata.get("output_hidden_states")),
                self._relative(start, end),
                prompts,
            )
            self.tokens_processed += hidden.shape[0] * hidden.shape[1]
            if self.metrics is not None:
                tokens = hidden.shape[0] * hidden.shape[1]
                self.metrics.observe_step("forward", time.perf_counter() - t0, tokens)
            compression = metadata.get("compression", "none")
            for message in protocol.split_message([out], {}, runtime_pb2.ExpertResponse, compression):
                yield message
        except (RemoteError, ValueError) as e:
            yield protocol.make_response(error=self._wire_error(e))
            await self._let_client_finish(requests)
        except Exception as e:
            logger.exception("forward failed")
            yield protocol.make_response(error={"code": "remote_error", "message": f"internal error: {e!r}"})

    async def rpc_backward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """``[hidden, grad_output(, prompts)]`` → ``[grad_hidden(, grad_prompts)]``."""
        try:
            tensors, metadata = await self._gather(requests, max_count=3)
            if len(tensors) not in (2, 3):
                raise InvalidInputError(
                    f"expected [hidden, grad_output] or [hidden, grad_output, prompts], got {len(tensors)}"
                )
            hidden, grad_output = self._check_hidden(tensors[:2], count=2)
            if hidden.shape != grad_output.shape:
                raise InvalidInputError(
                    f"grad_output shape {tuple(grad_output.shape)} != input {tuple(hidden.shape)}"
                )
            self._check_forward_size(hidden)
            start, end = self._blocks(metadata)
            prompts = self._check_prompts(tensors[2], hidden, end - start) if len(tensors) == 3 else None
            t0 = time.perf_counter()
            grad, grad_prompts = await self._compute(
                self.runner.backward, hidden, grad_output, self._relative(start, end), prompts
            )
            if self.metrics is not None:
                tokens = hidden.shape[0] * hidden.shape[1]
                self.metrics.observe_step("backward", time.perf_counter() - t0, tokens)
            grads = [grad] if grad_prompts is None else [grad, grad_prompts]
            compression = metadata.get("compression", "none")
            for message in protocol.split_message(grads, {}, runtime_pb2.ExpertResponse, compression):
                yield message
        except (RemoteError, ValueError) as e:
            yield protocol.make_response(error=self._wire_error(e))
            await self._let_client_finish(requests)
        except Exception as e:
            logger.exception("backward failed")
            yield protocol.make_response(error={"code": "remote_error", "message": f"internal error: {e!r}"})

    async def _let_client_finish(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], seconds: float = 1.0
    ) -> None:
        """After refusing a request mid-upload, read (and drop) what the client is still sending for a
        moment before closing: closing at once can reset the stream before the client reads the error.
        Bounded in time and bytes, so an endless upload still ends here."""
        budget = self.limits.max_tensor_bytes
        try:
            async with asyncio.timeout(seconds):
                async for message in requests:
                    budget -= sum(len(t.buffer) for t in message.tensors)
                    if budget < 0:
                        return
                # the client has sent everything: linger a moment so the refusal reaches it before the stream
                # closes (CI once saw the p2p stream end with the answer still in flight)
                await asyncio.sleep(REFUSAL_LINGER)
        except Exception:  # timeout or a broken stream: either way we are done
            return

    def _check_prompts(self, prompts: torch.Tensor, hidden: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """Deep prompts must be ``[num_blocks, B or 1, P <= T, H]``, finite floats within the size limit."""
        batch, length, hidden_size = hidden.shape
        if not prompts.dtype.is_floating_point or prompts.ndim != 4:
            raise InvalidInputError(
                f"prompts must be a floating point [blocks, batch, prefix, hidden] tensor, got "
                f"{prompts.dtype} {tuple(prompts.shape)}"
            )
        blocks, prompt_batch, prefix, size = prompts.shape
        fits = blocks == num_blocks and prompt_batch in (1, batch) and size == hidden_size
        if not fits or not 1 <= prefix <= length:
            raise InvalidInputError(
                f"prompts of shape {tuple(prompts.shape)} do not fit {num_blocks} blocks and hidden states "
                f"{tuple(hidden.shape)}: expected [{num_blocks}, {batch} or 1, 1..{length}, {hidden_size}]"
            )
        if prompts.numel() * prompts.element_size() > self.limits.max_tensor_bytes:
            raise InvalidInputError(
                f"prompts of {prompts.numel() * prompts.element_size()} bytes exceed the server's limit"
            )
        if not torch.isfinite(prompts).all():
            raise InvalidInputError("prompts contain NaN or inf")
        return prompts

    def _check_forward_size(self, hidden: torch.Tensor) -> None:
        if hidden.shape[0] * hidden.shape[1] > self.limits.max_forward_tokens:
            raise InvalidInputError(
                f"{hidden.shape[0] * hidden.shape[1]} tokens in one forward exceed the limit "
                f"{self.limits.max_forward_tokens}; split the batch"
            )

    @staticmethod
    def _wire_error(e: Exception) -> dict:
        if isinstance(e, RemoteError):
            return error_to_wire(e)
        return error_to_wire(InvalidInputError(str(e)))


class PushStream:
    """One long-lived stream to the next server of a chain, carrying a session's pushed steps.

    Opening a libp2p stream per step costs more than the hop a push saves, so a session keeps one
    stream per target and closes it when it ends. Failures only count: the client's own copy of every
    step still reaches the target.
    """

    def __init__(self, peer_id: str, sender: PushSender, handler: BlockHandler):
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
