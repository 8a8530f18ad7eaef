"""The RPC surface of one span of blocks: ``BlockHandler``, wiring the per-job modules together.

Each RPC lives with its job, and ``BlockHandler`` mixes them over one shared state (span, caches,
batcher, counters):

- ``worker.wire`` — checks of incoming metadata and tensors → typed errors (``HandlerLimits``);
- ``worker.inference`` — ``rpc_inference``: session streams and their steps;
- ``worker.push`` — ``rpc_push``: server-to-server push along the client's chain;
- ``worker.bundles`` — ``rpc_steps``: many sessions' steps in one message;
- ``worker.forward_backward`` — ``rpc_forward`` / ``rpc_backward``: stateless, no cache;
- here — ``rpc_info`` and the state itself.

Every request is validated before it touches a block; a bad request gets a structured error
(``swarm_client.errors``) and the server goes on serving everybody else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from swarm_client import protocol
from worker.batcher import StepBatcher
from worker.bundles import StepBundles
from worker.cache import CacheManager
from worker.compute import SpanRunner
from worker.early_pushes import EarlyPushes
from worker.forward_backward import ForwardBackward
from worker.metrics import WorkerMetrics
from worker.push import PushSender
from worker.uploads import UploadBudget
from worker.wire import HandlerLimits

__all__ = ["BlockHandler", "HandlerLimits"]


class BlockHandler(StepBundles, ForwardBackward, protocol.BlockRPC):
    """All RPCs of blocks ``[start, end)`` of one loaded span; ``worker.rebalance.HandlerSwitch`` routes to it."""

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
        self.uploads = UploadBudget(self.limits.max_upload_bytes)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.batcher = StepBatcher(runner, self.executor, single_stream=lambda: self.active_streams <= 1)
        self.accepting = True
        #: the LoRA adapters loaded into the span (``--adapters``), which sessions and requests may name
        self.adapters: frozenset[str] = frozenset()
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
        self.pushes_refused = 0
        self.pushes_dropped = 0
        #: pushes that came before their session opened here, held until it does (``worker.early_pushes``)
        self.early_pushes = EarlyPushes()
        self.pushes_held = 0
        #: clients' own copies of steps already run from a push (a client sends one only when the push is late)
        self.copies_after_push = 0

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
            "pushes_refused": self.pushes_refused,
            "pushes_dropped": self.pushes_dropped,
            "pushes_held": self.pushes_held,
            "copies_after_push": self.copies_after_push,
            "accepting": self.accepting,
            "uploads_refused": self.uploads.refused,
        }
        return runtime_pb2.ExpertInfo(serialized_info=protocol.pack_metadata(payload))
