"""Checking what a peer sends a block server: metadata and tensors in, typed errors out.

Every request is validated before it touches a block; a bad request becomes an ``InvalidInputError``
(or another ``swarm_client.errors`` type) that the RPC answers on the wire, and the server goes on
serving everybody else. Serialized tensors are judged by their header and byte count before any memory
is allocated for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import AsyncIterator  # noqa: UP035 - hivemind detects streams by typing.AsyncIterator only

import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming

from swarm_client import protocol
from swarm_client.errors import AdapterNotFoundError, InvalidInputError, RemoteError, error_to_wire
from worker.uploads import DEFAULT_UPLOAD_BUDGET

#: dtypes a tensor may arrive in (wire name → bytes per value once decoded); anything else is refused
WIRE_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
WIRE_MAX_NDIM = 4
_NONE, _FLOAT16 = runtime_pb2.CompressionType.NONE, runtime_pb2.CompressionType.FLOAT16


class HandlerLimits:
    """What one request may ask of a block server (sizes, tokens, idle time of a stream)."""

    def __init__(
        self,
        max_batch_size: int = 64,
        max_forward_tokens: int = 16384,
        max_tensor_bytes: int = 256 * 2**20,
        idle_timeout: float = 300.0,
        max_step_tokens: int = protocol.MAX_STEP_TOKENS,
        max_upload_bytes: int = DEFAULT_UPLOAD_BUDGET,
    ):
        self.max_upload_bytes = max_upload_bytes
        self.max_batch_size = max_batch_size
        self.max_step_tokens = max_step_tokens
        self.max_forward_tokens = max_forward_tokens
        self.max_tensor_bytes = max_tensor_bytes
        self.idle_timeout = idle_timeout


def wire_error(e: Exception) -> dict:
    """The wire form of a refusal: ``RemoteError``s as they are, anything else (``ValueError``) as invalid input."""
    if isinstance(e, RemoteError):
        return error_to_wire(e)
    return error_to_wire(InvalidInputError(str(e)))


def internal_error(e: Exception) -> dict:
    """The wire form of an unexpected failure on this server (logged by the caller)."""
    return {"code": "remote_error", "message": f"internal error: {e!r}"}


class WireChecks:
    """Validation of incoming requests, mixed into ``BlockHandler``; reads its limits, hidden size and span."""

    limits: HandlerLimits
    hidden_size: int
    start: int
    end: int
    adapters: frozenset[str]

    _wire_error = staticmethod(wire_error)

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
        self,
        requests: AsyncIterator[runtime_pb2.ExpertRequest],
        max_count: int,
        hold: Callable[[int], None] | None = None,
    ) -> tuple[list[torch.Tensor], dict]:
        """Like ``protocol.gather_message``, but stops reading as soon as the request outgrows the limits;
        ``hold(n)`` is told of every ``n`` bytes that arrive (and may refuse them)."""
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
                if hold is not None:
                    hold(len(part.buffer))
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

    def _check_step_size(self, hidden: torch.Tensor) -> None:
        tokens, limit = hidden.shape[0] * hidden.shape[1], self.limits.max_step_tokens
        if tokens > limit:
            raise InvalidInputError(
                f"a step of {tokens} tokens (batch × length) exceeds this server's limit of {limit} per step; "
                "split the prefill into several steps"
            )

    @staticmethod
    def _check_compression_out(metadata: dict) -> None:
        for key in ("compression", "compression_out"):
            value = metadata.get(key, "none")
            if not isinstance(value, str) or value not in protocol.COMPRESSIONS:
                raise InvalidInputError(
                    f"{key} must be one of {sorted(protocol.COMPRESSIONS)}, got {str(value)[:40]!r}"
                )

    def _check_forward_size(self, hidden: torch.Tensor) -> None:
        if hidden.shape[0] * hidden.shape[1] > self.limits.max_forward_tokens:
            raise InvalidInputError(
                f"{hidden.shape[0] * hidden.shape[1]} tokens in one forward exceed the limit "
                f"{self.limits.max_forward_tokens}; split the batch"
            )

    def _blocks(self, metadata: dict) -> tuple[int, int]:
        """The absolute sub-span ``[start, end)`` a request asks for (default: the whole span)."""
        start = metadata.get("start_block", self.start)
        end = metadata.get("end_block", self.end)
        if not (isinstance(start, int) and isinstance(end, int) and self.start <= start < end <= self.end):
            raise InvalidInputError(
                f"blocks {start!r}:{end!r} are not within this server's span {self.start}:{self.end}"
            )
        return start, end

    def _adapter(self, metadata: dict) -> str | None:
        """The LoRA adapter a session or request names (``"adapter"``), one this server holds; None: base."""
        name = metadata.get("adapter")
        if name is None:
            return None
        if not isinstance(name, str) or name not in self.adapters:
            held = ", ".join(sorted(self.adapters)) or "none"
            raise AdapterNotFoundError(
                f"this server holds no adapter {str(name)[:80]!r} (it holds: {held}); "
                "route through servers that announce it"
            )
        return name

    def _relative(self, start: int, end: int) -> slice:
        return slice(start - self.start, end - self.start)
