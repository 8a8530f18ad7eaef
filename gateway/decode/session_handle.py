"""One choice's ``DecodeSession`` as the engine holds it (``SessionHandle``): its blocking calls run one at
a time in a worker thread, and closing it — or, for a choice that may be continued by a later request,
detaching it into the affinity store — waits for the call in flight, shielded from cancellation.

Threading: every backend call (open/step/close) runs in a worker thread of the engine's own pool, since a
swarm step blocks on the network. A session never has two calls in flight: when a request is cancelled
(client gone, timeout) the call in flight finishes in its thread, then the session is closed.

Prefix reuse across requests (with an affinity store, gateway/affinity/sessions.py, and a ``ResumableBackend``,
gateway/backends/base.py): the engine claims the store's record sharing the longest prefix with choice 0's prompt
(or the record of the request's session key) and hands it here as a ``Reuse``; ``open_reusable`` resumes
its session (``open_session(resume=...)``; if the caches are gone, a fresh session instead). When the choice
finishes normally its session is *detached* — closed with the caches kept — and written back to the store
under the claimed record; a choice that fails or is cancelled closes its session (freeing the caches) and
leaves no record. If the servers lose a resumed session mid-request (``SessionLost``: its earlier inputs
are not known here, so failover cannot replay them), ``ReusableSession`` opens a fresh one and re-feeds
every token the old one held: same tokens, same logits, the output goes on unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import torch

from gateway.affinity.sessions import AffinityStore, Claim
from gateway.backends.base import DecodeSession, ModelBackend, ResumableBackend, ResumableSession, SessionSnapshot
from swarm_client.errors import SessionLost, SwarmError
from swarm_client.lora import adapter_field

logger = logging.getLogger(__name__)

__all__ = ["ReusableSession", "Reuse", "SessionHandle", "open_reusable"]

T = TypeVar("T")


class ReusableSession:
    """A session that may continue a previous request's caches (``resumed``). If the servers lose those
    mid-request (``SessionLost``), it opens a fresh session and feeds it every token the lost one held plus
    the new ones: the same cache and the same logits, so the caller cannot tell (``restarted`` says it)."""

    def __init__(
        self,
        backend: ResumableBackend,
        inner: ResumableSession,
        max_length: int,
        resumed: bool,
        adapter: str | None = None,
    ):
        self.backend = backend
        self.inner = inner
        self.max_length = max_length
        self.resumed = resumed
        self.restarted = False
        #: the LoRA adapter it runs (None: the base model); a fresh session replacing it runs the same one
        self.adapter = adapter

    @property
    def position(self) -> int:
        return self.inner.position

    @property
    def token_ids(self) -> list[int]:
        return self.inner.token_ids

    def step(self, token_ids: list[int], all_logits: bool = False) -> torch.Tensor:
        try:
            return self.inner.step(token_ids, all_logits) if all_logits else self.inner.step(token_ids)
        except SessionLost as exc:
            if not self.resumed:
                raise
            return self.recover(token_ids, exc, all_logits)

    def recover(self, token_ids: list[int], lost: SessionLost, all_logits: bool = False) -> torch.Tensor:
        """The servers lost this resumed session at a step of ``token_ids``: re-prefill a fresh one."""
        held = list(self.inner.token_ids)
        with contextlib.suppress(Exception):
            self.inner.close()
        logger.info(
            "a resumed session was lost (%s); re-prefilling %d tokens in a fresh one", lost, len(held)
        )
        self.inner = self.backend.open_session(self.max_length, **adapter_field(self.adapter))
        self.resumed, self.restarted = False, True
        if not all_logits:
            return self.inner.step(held + list(token_ids))
        return self.inner.step(held + list(token_ids), True)[-len(token_ids) :]

    def rollback(self, position: int) -> None:
        self.inner.rollback(position)

    def detach(self) -> SessionSnapshot:
        return self.inner.detach()

    def close(self) -> None:
        self.inner.close()


def open_reusable(
    backend: ResumableBackend, max_length: int, snapshot: SessionSnapshot | None, adapter: str | None = None
) -> ReusableSession:
    """Resume ``snapshot``'s session, or open a fresh one when there is none or its caches are gone (both
    running ``adapter``)."""
    inner: ResumableSession | None = None
    if snapshot is not None:
        try:
            inner = backend.open_session(max_length, resume=snapshot, **adapter_field(adapter))
        except SwarmError as exc:  # expired, evicted, a server left: prefill afresh
            logger.info("could not resume a cached session (%s); prefilling afresh", exc)
        except Exception:
            logger.warning("resuming a cached session failed; prefilling afresh", exc_info=True)
    resumed = inner is not None
    if inner is None:
        inner = backend.open_session(max_length, **adapter_field(adapter))
    return ReusableSession(backend, inner, max_length, resumed, adapter)


@dataclass
class Reuse:
    """Where a reusable choice's session comes from and goes when it finishes: the backend that resumes it,
    the store, the claimed record id."""

    backend: ResumableBackend
    store: AffinityStore
    claim: Claim
    replica: str


class SessionHandle:
    """Owns one ``DecodeSession``: its blocking calls run one at a time in a worker thread, and ``aclose``
    waits for the call in flight (even an ``open_session`` whose caller was cancelled) before closing it —
    or, for a reusable choice that completed, detaching it and writing it back to the affinity store."""

    def __init__(self, executor: Executor, reuse: Reuse | None = None) -> None:
        self._executor = executor
        self.session: DecodeSession | None = None
        self._opening: asyncio.Future[DecodeSession] | None = None
        self._inflight: asyncio.Future[Any] | None = None
        self._closed = False
        self.reuse = reuse
        #: set by the decode loop once the choice has finished normally: its caches are worth keeping
        self.completed = False
        #: when the request began opening this session: its time to first token counts from here
        self.opened_at = time.perf_counter()

    @property
    def closed(self) -> bool:
        """``aclose`` has run: the session no longer holds any server's cache (its reservation ends)."""
        return self._closed

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise RuntimeError("session already closed")
        return await self.wait(self.track(asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)))

    def track(self, fut: asyncio.Future[T]) -> asyncio.Future[T]:
        """Make ``fut`` — this session's one call in flight, wherever it runs — the call ``aclose`` waits for."""
        if self._closed:
            raise RuntimeError("session already closed")
        self._inflight = fut
        return fut

    @staticmethod
    async def wait(fut: asyncio.Future[T]) -> T:
        # shield: a cancelled caller must not leave the thread running while we close the session
        return await asyncio.shield(fut)

    async def open(self, backend: ModelBackend, max_length: int, adapter: str | None = None) -> None:
        """Open the session (``reuse``: resume its claimed one through ``reuse.backend``) for ``max_length``,
        running the LoRA ``adapter`` (None: the base model)."""
        if self.reuse is not None:
            record = self.reuse.claim.record
            snapshot = SessionSnapshot(record.state, record.token_ids) if record is not None else None
            opener: Callable[[], DecodeSession] = functools.partial(
                open_reusable, self.reuse.backend, max_length, snapshot, adapter
            )
        else:
            opener = functools.partial(backend.open_session, max_length, **adapter_field(adapter))
        fut = asyncio.get_running_loop().run_in_executor(self._executor, opener)
        self._opening = self._inflight = fut
        self.session = await asyncio.shield(fut)

    @property
    def cached_tokens_lost(self) -> bool:
        """True when a resumed session had to be rebuilt from scratch (nothing was reused after all)."""
        return bool(getattr(self.session, "restarted", False))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._inflight is not None and not self._inflight.done():
                await asyncio.wait([self._inflight])
            if self._inflight is not None and not self._inflight.cancelled():
                self._inflight.exception()  # retrieved: no "exception never retrieved" noise
            opening = self._opening
            opened = opening is not None and not opening.cancelled() and opening.exception() is None
            if self.session is None and opening is not None and opened:
                self.session = opening.result()
            if self.session is None:
                return
            if self.reuse is not None and self.completed and await self._detach(self.reuse):
                return
            try:
                await asyncio.get_running_loop().run_in_executor(self._executor, self.session.close)
            except Exception:
                logger.exception("closing a decode session failed")

    async def _detach(self, reuse: Reuse) -> bool:
        """Keep the caches and record them; False if the session could not be detached (close it then)."""
        if not reuse.store.available:  # nowhere to record it: free the caches now rather than at the TTL
            return False
        session = self.session
        assert isinstance(session, ReusableSession)  # ``open`` made one: this choice has a ``reuse``
        if not reuse.claim.keyed and len(session.token_ids) < reuse.store.block_tokens:
            return False  # shorter than one indexed block: no later prompt could find it
        try:
            snapshot = await asyncio.get_running_loop().run_in_executor(self._executor, session.detach)
        except Exception:
            logger.warning("detaching a finished session failed; closing it", exc_info=True)
            return False
        await reuse.store.save(reuse.claim, snapshot.state, snapshot.token_ids, reuse.replica)
        return True
