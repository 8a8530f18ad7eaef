"""RPC handlers of a block server: inference streams, stateless forward/backward, info.

Every request is validated before it touches a block; a bad request gets a structured error
(``swarm_client.errors``) and the server goes on serving everybody else.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import AsyncIterator  # noqa: UP035 - hivemind detects streams by typing.AsyncIterator only
from concurrent.futures import ThreadPoolExecutor

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from swarm_client import protocol
from swarm_client.errors import InvalidInputError, LengthExceededError, RemoteError, error_to_wire
from worker.cache import CacheManager, SessionCache
from worker.batcher import StepBatcher
from worker.compute import SpanRunner, StepItem

logger = logging.getLogger(__name__)


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
        self.batcher = StepBatcher(runner, self.executor)
        self.accepting = True
        #: test-only fault injection: "nan", "hang" or "wrong-shape" after ``fault_after`` inference steps
        self.fault: str | None = None
        self.fault_after = 0
        self.tokens_processed = 0
        self.inference_steps = 0
        self.active_streams = 0

    async def _compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # ---------------------------------------------------------------- validation
    def _check_hidden(self, tensors: list[torch.Tensor], count: int = 1) -> list[torch.Tensor]:
        if len(tensors) != count:
            raise InvalidInputError(f"expected {count} tensor(s), got {len(tensors)}")
        for t in tensors:
            if not t.dtype.is_floating_point:
                raise InvalidInputError(f"hidden states must be floating point, got {t.dtype}")
            if t.ndim != 3:
                raise InvalidInputError(f"hidden states must be [batch, tokens, hidden], got shape {tuple(t.shape)}")
            if t.shape[2] != self.hidden_size:
                raise InvalidInputError(f"hidden size {t.shape[2]} does not match this model's {self.hidden_size}")
            if t.shape[1] < 1 or t.shape[0] < 1:
                raise InvalidInputError(f"empty hidden states {tuple(t.shape)}")
            if t.numel() * t.element_size() > self.limits.max_tensor_bytes:
                raise InvalidInputError(f"tensor of {t.numel() * t.element_size()} bytes exceeds the server's limit")
            if not torch.isfinite(t).all():
                raise InvalidInputError("hidden states contain NaN or inf")
        return tensors

    def _blocks(self, metadata: dict) -> tuple[int, int]:
        """The absolute sub-span ``[start, end)`` a request asks for (default: the whole span)."""
        start = metadata.get("start_block", self.start)
        end = metadata.get("end_block", self.end)
        if not (isinstance(start, int) and isinstance(end, int) and self.start <= start < end <= self.end):
            raise InvalidInputError(f"blocks {start!r}:{end!r} are not within this server's span {self.start}:{self.end}")
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
            "batches": self.batcher.batches,
            "batched_steps": self.batcher.batched_items,
            "max_batch_seen": self.batcher.max_batch_seen,
            "accepting": self.accepting,
        }
        return runtime_pb2.ExpertInfo(serialized_info=protocol.pack_metadata(payload))

    # ---------------------------------------------------------------- inference
    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        owner = context.remote_id.to_base58() if context.remote_id is not None else None
        cache: SessionCache | None = None
        keep = False
        self.active_streams += 1
        try:
            try:
                first = await asyncio.wait_for(anext(requests), self.limits.idle_timeout)
                cache = self._open_session(protocol.unpack_metadata(first.metadata), owner)
            except (RemoteError, ValueError) as e:
                yield protocol.make_response(error=self._wire_error(e))
                return
            except (StopAsyncIteration, asyncio.TimeoutError):
                return
            yield protocol.make_response(position=cache.position, session_id=cache.session_id)

            while True:
                try:
                    request = await asyncio.wait_for(anext(requests), self.limits.idle_timeout)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    logger.info("session %s idle for %.0fs; closing it", cache.session_id, self.limits.idle_timeout)
                    break
                try:
                    metadata = protocol.unpack_metadata(request.metadata)
                    if "close" in metadata:
                        keep = bool(metadata["close"].get("keep", False))
                        break
                    tensors = [protocol.deserialize(t) for t in request.tensors]
                    out, position = await self._step(cache, tensors, metadata)
                    yield protocol.make_response([out], compression=metadata.get("compression", "none"), position=position)
                except (RemoteError, ValueError) as e:
                    yield protocol.make_response(error=self._wire_error(e))
                except Exception as e:  # never let one session take the server down
                    logger.exception("inference step failed")
                    yield protocol.make_response(error={"code": "remote_error", "message": f"internal error: {e!r}"})
        finally:
            self.active_streams -= 1
            if cache is not None:
                self.caches.release(cache.session_id, keep=keep)

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
            raise InvalidInputError(f"batch_size must be an int in [1, {self.limits.max_batch_size}], got {batch_size!r}")
        if not isinstance(max_length, int) or max_length < 1:
            raise InvalidInputError(f"max_length must be a positive int, got {max_length!r}")
        cache = self.caches.open(session_id, batch_size, max_length, owner=owner, num_layers=end - start)
        cache.blocks = self._relative(start, end)
        return cache

    async def _step(self, cache: SessionCache, tensors: list[torch.Tensor], metadata: dict) -> tuple[torch.Tensor, int]:
        (hidden,) = self._check_hidden(tensors)
        if hidden.shape[0] != cache.batch_size:
            raise InvalidInputError(f"batch size {hidden.shape[0]} does not match the session's {cache.batch_size}")
        position = metadata.get("position", cache.position)
        if not isinstance(position, int) or not 0 <= position <= cache.position:
            raise InvalidInputError(f"position {position!r} must be an int in [0, {cache.position}] (cached tokens)")
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
        if self.fault is not None and self.inference_steps > self.fault_after:
            out = await self._inject_fault(out)
        return out, cache.position

    async def _inject_fault(self, out: torch.Tensor) -> torch.Tensor:
        """Misbehave on purpose (``--fault``) so clients' failover can be tested against a real process."""
        if self.fault == "nan":
            return torch.full_like(out, float("nan"))
        if self.fault == "wrong-shape":
            return out[..., :-1]
        if self.fault == "hang":
            await asyncio.Event().wait()
        return out

    # ---------------------------------------------------------------- forward / backward
    async def rpc_forward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """``[hidden]`` or ``[hidden, prompts]`` → ``[out]`` (``[N, B, T, H]`` with output_hidden_states)."""
        try:
            tensors, metadata = await protocol.gather_message(requests)
            if len(tensors) not in (1, 2):
                raise InvalidInputError(f"expected [hidden] or [hidden, prompts], got {len(tensors)} tensors")
            (hidden,) = self._check_hidden(tensors[:1])
            self._check_forward_size(hidden)
            start, end = self._blocks(metadata)
            prompts = self._check_prompts(tensors[1], hidden, end - start) if len(tensors) == 2 else None
            out = await self._compute(
                self.runner.forward,
                hidden,
                bool(metadata.get("output_hidden_states")),
                self._relative(start, end),
                prompts,
            )
            self.tokens_processed += hidden.shape[0] * hidden.shape[1]
            compression = metadata.get("compression", "none")
            for message in protocol.split_message([out], {}, runtime_pb2.ExpertResponse, compression):
                yield message
        except (RemoteError, ValueError) as e:
            yield protocol.make_response(error=self._wire_error(e))
        except Exception as e:
            logger.exception("forward failed")
            yield protocol.make_response(error={"code": "remote_error", "message": f"internal error: {e!r}"})

    async def rpc_backward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """``[hidden, grad_output(, prompts)]`` → ``[grad_hidden(, grad_prompts)]``."""
        try:
            tensors, metadata = await protocol.gather_message(requests)
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
            grad, grad_prompts = await self._compute(
                self.runner.backward, hidden, grad_output, self._relative(start, end), prompts
            )
            grads = [grad] if grad_prompts is None else [grad, grad_prompts]
            compression = metadata.get("compression", "none")
            for message in protocol.split_message(grads, {}, runtime_pb2.ExpertResponse, compression):
                yield message
        except (RemoteError, ValueError) as e:
            yield protocol.make_response(error=self._wire_error(e))
        except Exception as e:
            logger.exception("backward failed")
            yield protocol.make_response(error={"code": "remote_error", "message": f"internal error: {e!r}"})

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
