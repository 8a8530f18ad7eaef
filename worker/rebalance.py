"""Moving a running ``--num-blocks`` server to where the swarm is weakest, without a coverage dip.

The decisions are pure functions (``balancing_view``, ``plan_move``, ``joining_range``, ``retired_ranges``,
``tombstone``, ``jittered``); ``HandlerSwitch`` is the thin piece of I/O that lets the server swap its span
under live RPC handlers. ``worker.server.BlockServer`` runs the loop:

    every ``jittered(rebalance_period)``: read the DHT (``balancing_view``) → ``plan_move`` → wait a random
    while → re-read and ``plan_move`` again (so two servers that saw the same gap do not both run to it):
    announce JOINING (``joining_range``) → load the new blocks → ``HandlerSwitch.switch_to`` → announce the
    new span ONLINE → ``tombstone`` the old blocks no longer served → let streams on the old span finish.

Why the odd-looking records: readers collapse a peer's per-block records into *one* span, taken from its
lowest-indexed valid record (``swarm_client.dht_records.spans_from_records``; a record whose own span does
not contain its block is skipped). So a JOINING record on a block below the old span would hide the old,
still-served span from every client for the whole load, and an OFFLINE record carrying the *old* span's
bounds below the new span would hide the new one until it expired. Hence JOINING only above the old
span's first block, and tombstones that carry the *new* span's bounds: valid ServerInfo, ignored for the
blocks they retire.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping, Sequence
from typing import AsyncIterator  # noqa: UP035 - hivemind detects streams by typing.AsyncIterator only

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from swarm_client import protocol
from swarm_client.dht_records import RemoteSpanInfo, ServerInfo, ServerState, spans_from_records
from swarm_client.errors import RemoteError, SessionNotFoundError, error_to_wire
from worker.block_selection import choose_best_blocks, should_choose_other_blocks
from worker.bundles import serve_step_bundles
from worker.handler import BlockHandler
from worker.push import serve_pushes

__all__ = [
    "PENDING",
    "HandlerSwitch",
    "balancing_view",
    "jittered",
    "joining_range",
    "plan_move",
    "retired_ranges",
    "tombstone",
]

logger = logging.getLogger(__name__)

Span = tuple[int, int]


# ---------------------------------------------------------------------------------------------- decisions
#: suffix of the pseudo-peer that stands for another server's move in progress (``balancing_view``)
PENDING = "/joining"


def balancing_view(records: Sequence[Mapping[str, ServerInfo]]) -> dict[str, RemoteSpanInfo]:
    """``spans_from_records`` plus one pseudo-peer ``"{peer}/joining"`` per server that is loading a span
    other than the one readers see (a move in progress), so two servers do not both run to the same gap.

    Only balancing uses this view; routing must never see the pseudo-peers.
    """
    spans = spans_from_records(records)
    pending: dict[str, RemoteSpanInfo] = {}
    for block, per_peer in enumerate(records):
        for peer_id, info in per_peer.items():
            seen = spans.get(peer_id)
            if info.state != ServerState.JOINING or not info.start_block <= block < info.end_block:
                continue
            if seen is None or (seen.start, seen.end) == (info.start_block, info.end_block):
                continue  # a plain joining server: already in the view
            key = f"{peer_id}{PENDING}"
            pending.setdefault(key, RemoteSpanInfo(key, info.start_block, info.end_block, info))
    return {**spans, **pending}


def plan_move(
    my_peer_id: str,
    spans: Mapping[str, RemoteSpanInfo],
    num_blocks: int,
    *,
    balance_quality: float = 0.75,
) -> Span | None:
    """The span this server should move to, or None to stay.

    A move is planned only when ``should_choose_other_blocks`` says it lifts the swarm's weakest block by
    the ``balance_quality`` factor; the target is where a fresh server of the same length would go if this
    one were gone (``choose_best_blocks`` over the others).
    """
    spans = {peer: span for peer, span in spans.items() if peer != f"{my_peer_id}{PENDING}"}
    if not should_choose_other_blocks(my_peer_id, spans, num_blocks, balance_quality=balance_quality):
        return None
    mine = spans[my_peer_id]
    length = max(1, min(mine.end, num_blocks) - max(mine.start, 0))
    others = {peer: span for peer, span in spans.items() if peer != my_peer_id}
    target = choose_best_blocks(length, others, num_blocks)
    return None if target == (mine.start, mine.end) else target


def joining_range(old: Span, new: Span) -> Span | None:
    """Blocks of ``new`` that may carry a JOINING record while ``old`` is still served: those above
    ``old``'s first block, so readers keep seeing the old span (see the module docstring). None if empty."""
    start = max(new[0], old[0] + 1)
    return (start, new[1]) if start < new[1] else None


def retired_ranges(old: Span, new: Span) -> list[Span]:
    """The blocks of ``old`` that ``new`` does not cover, as contiguous ``[start, end)`` ranges."""
    ranges = [(old[0], min(old[1], new[0])), (max(old[0], new[1]), old[1])]
    return [(lo, hi) for lo, hi in ranges if lo < hi]


def tombstone(current: ServerInfo) -> ServerInfo:
    """The OFFLINE record for a block this server just left: it carries the server's *current* span, so a
    reader neither routes the retired block here nor mistakes the peer's span for the old one."""
    return current.model_copy(update={"state": ServerState.OFFLINE})


def jittered(period: float, rng: random.Random, spread: float = 0.5) -> float:
    """``period`` scaled by a uniform factor in ``[1 - spread, 1 + spread]``: servers started together
    drift apart instead of checking (and moving) in lockstep."""
    return max(0.0, period * rng.uniform(1.0 - spread, 1.0 + spread))


# ---------------------------------------------------------------------------------------------- I/O
class HandlerSwitch(protocol.BlockRPC):
    """The RPC surface registered once on the p2p daemon; delegates to the server's current handler.

    ``switch_to`` swaps in a handler for another span: streams already running stay on the old handler
    until they end (it stops taking new sessions), and a request for blocks this server no longer holds
    gets a plain ``RemoteError`` — clients treat that as "re-route", unlike ``InvalidInputError``.
    """

    def __init__(self, handler: BlockHandler):
        self.current = handler
        self.retired: list[BlockHandler] = []
        self.p2p = None

    async def add_p2p_handlers(self, p2p, *args, **kwargs) -> None:
        """Register the RPCs; handlers learn the p2p too (where callers connect from: ``worker.cache_policy``)."""
        self.p2p = self.current.p2p = p2p
        await super().add_p2p_handlers(p2p, *args, **kwargs)

    def switch_to(self, handler: BlockHandler) -> BlockHandler:
        """Make ``handler`` current; return the previous one (now retired: no new sessions)."""
        handler.p2p = self.p2p
        old, self.current = self.current, handler
        old.accepting = False
        self.retired.append(old)
        return old

    async def retire(self, handler: BlockHandler, poll: float = 0.1) -> None:
        """Wait until the retired ``handler`` has no streams left, then free its compute thread and blocks."""
        while handler.active_streams > 0:
            await asyncio.sleep(poll)
        handler.executor.shutdown(wait=False, cancel_futures=True)
        if handler in self.retired:
            self.retired.remove(handler)
        logger.info("released blocks %d:%d", handler.start, handler.end)

    @property
    def handlers(self) -> list[BlockHandler]:
        return [self.current, *self.retired]

    @property
    def active_streams(self) -> int:
        return sum(h.active_streams for h in self.handlers)

    @staticmethod
    def _misrouted(handler: BlockHandler, spec: dict) -> RemoteError | None:
        """An error if ``spec`` asks for blocks outside ``handler``'s span (a client with a stale view)."""
        start, end = spec.get("start_block", handler.start), spec.get("end_block", handler.end)
        if not (isinstance(start, int) and isinstance(end, int)):
            return None  # malformed: the handler's own validation answers it
        if handler.start <= start < end <= handler.end:
            return None
        message = (
            f"this server now serves blocks {handler.start}:{handler.end}, not {start}:{end}; "
            "re-read the swarm and route elsewhere"
        )
        return SessionNotFoundError(message) if spec.get("resume") else RemoteError(message)

    async def _route(
        self, method: str, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Peek at the first request, check its blocks against the current span, hand the whole stream on."""
        try:
            first = await asyncio.wait_for(anext(requests), self.current.limits.idle_timeout)
        except (TimeoutError, StopAsyncIteration):
            return
        handler = self.current  # one handler for the whole stream, even if a switch happens meanwhile
        try:
            metadata = protocol.unpack_metadata(first.metadata)
        except Exception:  # garbage: the handler's own validation answers it
            metadata = {}
        spec = metadata.get("open") if method == "rpc_inference" else metadata
        error = self._misrouted(handler, spec) if isinstance(spec, dict) else None
        if error is not None:
            yield protocol.make_response(error=error_to_wire(error))
            return

        async def replayed() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            yield first
            async for request in requests:
                yield request

        async for response in getattr(handler, method)(replayed(), context):
            yield response

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        return await self.current.rpc_info(request, context)

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._route("rpc_inference", requests, context):
            yield response

    async def rpc_push(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Each pushed step to whichever handler (current or retired) holds its session's stream."""
        async for response in serve_pushes(requests, self.handlers):
            yield response

    async def rpc_steps(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Each bundled step to whichever handler (current or retired) holds its session's stream."""
        async for response in serve_step_bundles(requests, context, lambda: self.handlers):
            yield response

    async def rpc_forward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._route("rpc_forward", requests, context):
            yield response

    async def rpc_backward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._route("rpc_backward", requests, context):
            yield response
