"""Stream slots: how many choices the gateway decodes at once, and a bounded, first-come-first-served line
for the rest (503 + Retry-After beyond it).

A slot is one choice, not one request: a request with ``n=16`` decodes 16 sessions — 16 steps per token,
16 samplers, 16 times the detokenizing and framing — so it holds 16 slots (a 400 naming ``n`` when it asks
for more than there are). ``StreamLimitMiddleware`` takes one slot for every generation request before the
route parses it, and holds what the request holds until its last byte is sent; the route, once it knows the
request's choices, grows that to their count (``hold_choices``).

The default (``auto_stream_slots``): 8 choices per CPU core, at most ``backend_threads`` (each step in
flight holds one), at least ``max_choices`` (so the largest ``n`` the gateway accepts fits). Every running
choice costs the gateway's CPU each token — sampling over the vocabulary, a grammar's mask, detokenizing,
the SSE frame, in threads that share one GIL with the event loop — and past a few per core every stream
slows together: 200 concurrent chats beside one innocent stream (the audit's 7 s gap), 2-core machine,
tiny model in-process, the event loop's largest lag was 0.08 s with 4 slots, 0.34 s with 16, 1.6 s with 32
and 1.2-1.7 s unlimited (64 threads); the 200 chats also finished sooner with 4 slots (25.5 s) than
unlimited (38 s). Waiting in line is the better answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admission.ratelimit import GENERATION_PATHS
from gateway.errors import InvalidRequestError, ServiceUnavailableError, error_response

logger = logging.getLogger(__name__)

__all__ = [
    "CHOICES_PER_CORE",
    "SlotHold",
    "StreamLimitMiddleware",
    "StreamSlots",
    "StreamsSaturatedError",
    "auto_stream_slots",
    "hold_choices",
]

#: choices one CPU core of the gateway keeps decoding without stalling the others (module docstring)
CHOICES_PER_CORE = 8
_HOLD_STATE_KEY = "swarmserve.slot_hold"


def auto_stream_slots(backend_threads: int, max_choices: int = 1, cores: int | None = None) -> int:
    """The default number of stream slots: ``CHOICES_PER_CORE`` per core, at most ``backend_threads``, at
    least ``max_choices``."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, max_choices, min(backend_threads, CHOICES_PER_CORE * cores))


class StreamsSaturatedError(ServiceUnavailableError):
    def __init__(self, message: str, *, retry_after_s: int):
        super().__init__(message, code="streams_saturated", retry_after_s=retry_after_s)


class StreamSlots:
    """At most ``max_active`` slots taken at once; up to ``max_queued`` more requests wait, first come first
    served, at most ``queue_timeout_s`` (0: as long as it takes). ``max_active == 0``: unlimited."""

    def __init__(self, max_active: int, max_queued: int = 0, queue_timeout_s: float = 30.0, retry_after_s: int = 5):
        self.max_active = max_active
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.active = 0
        self._waiters: deque[tuple[asyncio.Future[None], int]] = deque()

    @property
    def queued(self) -> int:
        return sum(1 for w, _ in self._waiters if not w.done())

    @asynccontextmanager
    async def slot(self, weight: int = 1) -> AsyncIterator[None]:
        await self.acquire(weight)
        try:
            yield
        finally:
            self.release(weight)

    def try_acquire(self, weight: int = 1) -> bool:
        """Take ``weight`` slots now if they are free and nobody waits before us."""
        if self.max_active <= 0 or (self.active + weight <= self.max_active and not self.queued):
            self.active += weight
            return True
        return False

    async def acquire(self, weight: int = 1) -> None:
        """Take ``weight`` slots, waiting in line for them; a 400 naming ``n`` when there are fewer in all, a
        503 when the line is full or the wait is longer than ``queue_timeout_s``."""
        if self.max_active > 0 and weight > self.max_active:
            raise InvalidRequestError(
                f"n: this request's {weight} choices would each hold a stream slot; this server decodes at most "
                f"{self.max_active} choices at once. Ask for fewer choices.",
                param="n",
                code="too_many_choices",
            )
        if self.try_acquire(weight):
            return
        if self.queued >= self.max_queued:
            raise StreamsSaturatedError(
                f"The server is at its limit of {self.max_active} choices decoding at once and "
                f"{self.max_queued} requests queued; retry later.",
                retry_after_s=self.retry_after_s,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (waiter, weight)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(self.queue_timeout_s or None):
                await waiter  # _wake() counts us in before it wakes us
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self.release(weight)  # slots were handed over just as we gave up: pass them on
            else:
                waiter.cancel()
            if isinstance(exc, TimeoutError):
                raise StreamsSaturatedError(
                    f"No stream slot freed up within {self.queue_timeout_s:g}s "
                    f"({self.max_active} choices decoding at once at most); retry later.",
                    retry_after_s=self.retry_after_s,
                ) from None
            raise
        finally:
            try:
                self._waiters.remove(entry)
            except ValueError:
                pass
            self._wake()  # a cancelled head of the line may have been what the next one waited behind

    def release(self, weight: int = 1) -> None:
        self.active -= weight
        self._wake()

    def _wake(self) -> None:
        """Hand slots to the head of the line while it fits (first come, first served: a small request never
        overtakes a big one that waits)."""
        while self._waiters:
            waiter, weight = self._waiters[0]
            if waiter.done():
                self._waiters.popleft()
                continue
            if self.max_active > 0 and self.active + weight > self.max_active:
                return
            self._waiters.popleft()
            self.active += weight
            waiter.set_result(None)


class SlotHold:
    """The slots one request holds: one from the middleware, its choices' count once the route knows it."""

    def __init__(self, slots: StreamSlots):
        self.slots = slots
        self.weight = 0

    async def acquire(self, weight: int) -> None:
        await self.slots.acquire(weight)
        self.weight = weight

    async def grow(self, weight: int) -> None:
        """Hold ``weight`` slots in all: the extra ones at once when free, else let go of what is held and
        wait in line for all of them (holding some while waiting for more could deadlock)."""
        extra = weight - self.weight
        if extra <= 0 or self.slots.try_acquire(extra):
            self.weight = max(self.weight, weight)
            return
        held, self.weight = self.weight, 0
        self.slots.release(held)
        await self.acquire(weight)

    def release(self) -> None:
        held, self.weight = self.weight, 0
        if held:
            self.slots.release(held)


async def hold_choices(request: Request, choices: int) -> None:
    """The route's half: the request holds one slot per choice (a 400 naming ``n`` beyond the limit, a 503
    when none frees up in time). Nothing to do without a limit."""
    hold: SlotHold | None = request.scope.get("state", {}).get(_HOLD_STATE_KEY)
    if hold is not None:
        await hold.grow(choices)


def _is_generation(scope: Scope) -> bool:
    return scope["type"] == "http" and scope.get("method") == "POST" and scope.get("path") in GENERATION_PATHS


class StreamLimitMiddleware:
    """Holds a ``SlotHold`` for the whole life of a generation request, streaming or not (until its last byte
    is sent or its client is gone); 503 + Retry-After when no slot is free and the line is full.
    Non-streaming requests take slots too: they hold the same sessions and compute, and were a way around
    the limit (a flood of them was unbounded concurrency)."""

    def __init__(self, app: ASGIApp, slots: StreamSlots):
        self.app = app
        self.slots = slots

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.slots.max_active <= 0 or not _is_generation(scope):
            await self.app(scope, receive, send)
            return
        hold = SlotHold(self.slots)
        try:
            await hold.acquire(1)
        except StreamsSaturatedError as exc:
            logger.info("%s %s → 503 (%s)", scope.get("method"), scope.get("path"), exc.message)
            await error_response(exc)(scope, receive, send)
            return
        scope.setdefault("state", {})[_HOLD_STATE_KEY] = hold
        try:
            await self.app(scope, receive, send)
        finally:
            hold.release()
