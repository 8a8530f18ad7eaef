"""Stateless forward and backward through the span (no session, no cache), e.g. for prompt tuning.

Each RPC gathers one streamed request, checks it (``worker.wire``), runs it on the compute thread and
streams the result back; a refusal is answered as an error message while the rest of the upload is
drained for a moment, so the client reads the error instead of a reset stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator  # noqa: UP035 - hivemind detects streams by typing.AsyncIterator only

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from swarm_client import protocol
from swarm_client.errors import InvalidInputError, RemoteError
from worker.compute import SpanRunner
from worker.metrics import WorkerMetrics
from worker.uploads import UploadBudget
from worker.wire import WireChecks, internal_error

logger = logging.getLogger(__name__)
#: after refusing a request, keep the stream open this long once the client has sent everything
REFUSAL_LINGER = 0.1


class ForwardBackward(WireChecks):
    """``rpc_forward`` and ``rpc_backward``, mixed into ``BlockHandler``."""

    runner: SpanRunner
    uploads: UploadBudget
    executor: ThreadPoolExecutor
    tokens_processed: int
    metrics: WorkerMetrics | None

    async def _compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def rpc_forward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """``[hidden]`` or ``[hidden, prompts]`` → ``[out]`` (``[N, B, T, H]`` with output_hidden_states)."""
        try:
            with self.uploads.hold() as held:
                tensors, metadata = await self._gather(requests, max_count=2, hold=held.add)
                self._check_compression_out(metadata)
                if len(tensors) not in (1, 2):
                    raise InvalidInputError(f"expected [hidden] or [hidden, prompts], got {len(tensors)} tensors")
                (hidden,) = self._check_hidden(tensors[:1])
                self._check_forward_size(hidden)
                start, end = self._blocks(metadata)
                prompts = self._check_prompts(tensors[1], hidden, end - start) if len(tensors) == 2 else None
                adapter = self._adapter(metadata)
                t0 = time.perf_counter()
                out = await self._compute(
                    self.runner.forward,
                    hidden,
                    bool(metadata.get("output_hidden_states")),
                    self._relative(start, end),
                    prompts,
                    adapter,
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
            yield protocol.make_response(error=internal_error(e))

    async def rpc_backward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """``[hidden, grad_output(, prompts)]`` → ``[grad_hidden(, grad_prompts)]``."""
        try:
            with self.uploads.hold() as held:
                tensors, metadata = await self._gather(requests, max_count=3, hold=held.add)
                self._check_compression_out(metadata)
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
                adapter = self._adapter(metadata)
                t0 = time.perf_counter()
                grad, grad_prompts = await self._compute(
                    self.runner.backward, hidden, grad_output, self._relative(start, end), prompts, adapter
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
            yield protocol.make_response(error=internal_error(e))

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
