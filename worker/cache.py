"""Per-session KV caches within a token budget.

The budget counts *token slots*: one slot holds one token's keys and values in every block this server
serves, for one sequence of the batch. Caches grow on demand (doubling, capped at the session's
``max_length``) instead of reserving ``max_length`` up front as Petals does, so short chats leave room
for many concurrent sessions. Sessions whose stream ended can be kept *detached* for ``session_ttl``
seconds so a later stream resumes them; detached sessions are evicted when space is needed, those never resumed
first, least recently used first (``worker.cache_policy.keep_order``).

Abuse limits: at most ``max_sessions_per_peer`` attached sessions per remote peer and ``max_sessions``
sessions in all (detached ones are evicted first). Tokens count against a *holder* (the caller's address;
``worker.cache_policy``): a holder beyond its ``peer_share`` of the cache keeps the excess only until a holder
within its share needs room — then its idle sessions are evicted (``evict``: the stream's next step gets
``SessionEvictedError``), and streams idle past ``idle_limit`` close sooner while the cache is nearly full.
Being full is answered with a typed ``ServerBusyError``
saying what is free (clients route elsewhere and never ban a full server); a session that could never fit
(``max_length`` over the whole budget) with ``SessionTooLongError``. Nothing here runs on a timer: the server calls
``expire()`` periodically so detached sessions go even when no request arrives.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from swarm_client.capabilities import token_matches
from swarm_client.errors import (
    InvalidInputError,
    ServerBusyError,
    SessionAccessError,
    SessionEvictedError,
    SessionNotFoundError,
    SessionTooLongError,
)
from swarm_client.families import CacheLayout
from worker.cache_policy import Holding, choose_victims, idle_limit, keep_order

MIN_CAPACITY = 64
#: evicted session ids remembered, so a bundled step for one is told why it is gone
REMEMBERED_EVICTIONS = 4096


@dataclass(eq=False)
class SessionCache:
    session_id: str
    batch_size: int
    max_length: int
    num_layers: int
    layout: CacheLayout
    dtype: torch.dtype
    device: torch.device
    #: per layer (keys, values), each ``[batch, kv_heads, capacity, head_dim]``
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    capacity: int = 0
    position: int = 0
    attached: bool = True
    last_used: float = field(default_factory=time.monotonic)
    owner: str | None = None
    #: the peer that opened the session, the digest of its resume token and its push key
    #: (``swarm_client.capabilities``: a pushed step needs the client's authorization under that key)
    creator: str | None = None
    resume_digest: bytes | None = None
    push_key: str | None = None
    #: the newest step counter (``seq``) run for this session: a pushed step must be newer to run
    last_seq: int = 0
    #: which of the server's blocks (relative slice) this session runs through
    blocks: slice = field(default_factory=lambda: slice(None))
    #: the LoRA adapter the session runs with (``swarm_client.lora``); None: the base model
    adapter: str | None = None
    #: the client's pipeline group (worker/batcher.py batches one group at a time); None: no group
    batch_group: int | None = None
    #: whom its tokens count against (``worker.cache_policy.holder_of``); set when evicted to make room
    holder: str = ""
    evicted: bool = False
    #: how many times a stream re-attached it (``resume``): kept sessions never resumed are evicted first
    resumes: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def slots(self) -> int:
        return self.capacity * self.batch_size

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def layer_kv(self) -> Sequence[tuple[torch.Tensor, torch.Tensor]]:
        return self.kv


class CacheManager:
    def __init__(
        self,
        max_tokens: int,
        num_layers: int,
        layout: CacheLayout,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        session_ttl: float = 0.0,
        max_sessions_per_peer: int = 64,
        max_sessions: int = 4096,
        peer_share: float = 1.0,
        evict_idle_after: float = 2.0,
        pressure_idle_timeout: float = 30.0,
        pressure_free: float = 0.1,
    ):
        self.max_tokens = max_tokens
        self.num_layers = num_layers
        self.layout = layout
        self.dtype = dtype
        self.device = torch.device(device)
        self.session_ttl = session_ttl
        self.max_sessions_per_peer = max_sessions_per_peer
        self.max_sessions = max_sessions
        self.sessions: dict[str, SessionCache] = {}
        self.used_slots = 0
        #: attached sessions per owner peer (kept in step with ``sessions``: counting them is O(n) per open)
        self._owned: Counter[str] = Counter()
        self.peer_share = peer_share
        self.evict_idle_after = evict_idle_after
        self.pressure_idle_timeout = pressure_idle_timeout
        self.pressure_free = pressure_free
        #: sessions evicted for another holder's room: how many, and the latest ids
        self.evictions = 0
        self.evicted_ids: OrderedDict[str, None] = OrderedDict()

    @property
    def tokens_left(self) -> int:
        return self.max_tokens - self.used_slots

    @property
    def bytes_per_slot(self) -> int:
        return self.layout.bytes_per_token(self.dtype) * self.num_layers

    def open(
        self,
        session_id: str,
        batch_size: int,
        max_length: int,
        owner: str | None = None,
        num_layers: int | None = None,
        holder: str | None = None,
    ) -> SessionCache:
        """Register a new attached session (no memory yet beyond the first small chunk); its tokens count
        against ``holder`` (default: ``owner``)."""
        if session_id in self.sessions:
            raise InvalidInputError(f"session {session_id!r} already exists on this server; resume it instead")
        self._check_fits(batch_size, max_length)
        self._check_owner(owner)
        self._make_session_room()
        layers = self.num_layers if num_layers is None else num_layers
        cache = SessionCache(session_id, batch_size, max_length, layers, self.layout, self.dtype, self.device)
        cache.creator = owner
        cache.holder = holder or owner or ""
        self.sessions[session_id] = cache
        self._attach(cache, owner)
        try:
            self.ensure_capacity(cache, min(max_length, MIN_CAPACITY))
        except BaseException:
            self.free(session_id)
            raise
        return cache

    def _check_fits(self, batch_size: int, max_length: int) -> None:
        """A session that could never fit here, even with the whole budget, is refused up front (only the
        first chunk is allocated now: the cache grows as it fills, up to ``max_length``)."""
        if batch_size * max_length > self.max_tokens:
            raise SessionTooLongError(
                f"batch_size * max_length = {batch_size * max_length} token slots exceeds this server's whole "
                f"cache budget of {self.max_tokens}; ask for a shorter max_length or use another server",
                details={"cache_tokens_total": self.max_tokens},
            )

    def _busy(self, reason: str, message: str) -> ServerBusyError:
        return ServerBusyError(
            f"{message}; retry later or route to another server",
            details={"reason": reason, **self.room()},
        )

    def room(self) -> dict[str, int]:
        """What is free now: token slots, and session slots (detached sessions can be evicted)."""
        attached = sum(1 for s in self.sessions.values() if s.attached)
        return {"cache_tokens_left": max(0, self.tokens_left), "sessions_left": max(0, self.max_sessions - attached)}

    def _check_owner(self, owner: str | None) -> None:
        if owner is not None and self._owned[owner] >= self.max_sessions_per_peer:
            limit = self.max_sessions_per_peer
            raise self._busy("peer_sessions", f"this peer holds its maximum of {limit} sessions on this server")

    def _detached(self, exclude: SessionCache | None = None) -> list[SessionCache]:
        """Kept sessions in the order they go when room is needed (``keep_order``)."""
        kept = (s for s in self.sessions.values() if not s.attached and s is not exclude)
        return sorted(kept, key=lambda s: keep_order(s.resumes, s.last_used))

    def _make_session_room(self) -> None:
        """Keep the session count under ``max_sessions``: expire, then evict detached sessions (``keep_order``)."""
        if len(self.sessions) < self.max_sessions:
            return
        self.expire()
        detached = self._detached()
        for victim in detached[: len(self.sessions) - self.max_sessions + 1]:
            self.free(victim.session_id)
        if len(self.sessions) >= self.max_sessions:
            raise self._busy("sessions", f"server holds its maximum of {self.max_sessions} sessions")

    def _attach(self, cache: SessionCache, owner: str | None) -> None:
        cache.attached, cache.owner = True, owner
        if owner is not None:
            self._owned[owner] += 1

    def _detach(self, cache: SessionCache) -> None:
        if cache.attached and cache.owner is not None:
            self._owned[cache.owner] -= 1
            if self._owned[cache.owner] <= 0:
                del self._owned[cache.owner]
        cache.attached, cache.owner = False, None

    def resume(
        self,
        session_id: str,
        owner: str | None = None,
        max_length: int | None = None,
        resume_token: object = None,
        holder: str | None = None,
    ) -> SessionCache:
        """Re-attach a detached session; a larger ``max_length`` raises its cap (a conversation's next turn
        may be longer than the first request asked for) if the budget could ever hold it.

        Only its creator may: the holder of the resume token it was opened with, or (opened without one)
        the same peer. Anyone else gets ``SessionAccessError`` — and learns nothing a wrong guess would not."""
        self.expire()
        cache = self.sessions.get(session_id)
        if cache is None:
            raise SessionNotFoundError(
                f"session {session_id!r} is not on this server (expired, evicted or never opened)"
            )
        allowed = (
            token_matches(resume_token, cache.resume_digest)
            if cache.resume_digest is not None
            else cache.creator == owner
        )
        if not allowed:
            raise SessionAccessError(
                f"session {session_id!r} was opened by another client; resuming it needs the resume token it "
                "was opened with — open a new session instead"
            )
        if cache.attached:
            raise InvalidInputError(f"session {session_id!r} is in use by another stream")
        if max_length is not None and max_length > cache.max_length:
            self._check_fits(cache.batch_size, max_length)
        self._check_owner(owner)
        if max_length is not None and max_length > cache.max_length:
            cache.max_length = max_length
        self._attach(cache, owner)
        cache.holder = holder or owner or cache.holder
        cache.resumes += 1
        cache.touch()
        return cache

    def ensure_capacity(self, cache: SessionCache, length: int) -> None:
        """Grow ``cache`` so ``length`` tokens fit, evicting detached sessions if the budget needs it."""
        if length <= cache.capacity:
            return
        if length > cache.max_length:
            raise InvalidInputError(f"{length} tokens exceed the session's max_length {cache.max_length}")
        new_capacity = min(cache.max_length, max(length, 2 * cache.capacity, MIN_CAPACITY))
        extra = (new_capacity - cache.capacity) * cache.batch_size
        self._make_room(extra, exclude=cache, holder=cache.holder)
        shape = (cache.batch_size, self.layout.num_kv_heads, new_capacity, self.layout.head_dim)
        new_kv = []
        for layer in range(cache.num_layers):
            k = torch.empty(shape, dtype=self.dtype, device=self.device)
            v = torch.empty(shape, dtype=self.dtype, device=self.device)
            if cache.kv:
                old_k, old_v = cache.kv[layer]
                k[:, :, : cache.position] = old_k[:, :, : cache.position]
                v[:, :, : cache.position] = old_v[:, :, : cache.position]
            new_kv.append((k, v))
        cache.kv = new_kv
        self.used_slots += extra
        cache.capacity = new_capacity

    def _make_room(self, slots: int, exclude: SessionCache | None = None, holder: str = "") -> None:
        self.expire()
        if self.tokens_left >= slots:
            return
        for victim in self._detached(exclude):
            self.free(victim.session_id)
            if self.tokens_left >= slots:
                return
        self._reclaim(slots, holder, exclude)
        if self.tokens_left >= slots:
            return
        needed, left = slots, self.tokens_left
        total = self.max_tokens
        raise self._busy("cache", f"server cache is full: {needed} token slots needed, {left} free of {total}")

    def _reclaim(self, slots: int, holder: str, exclude: SessionCache | None) -> None:
        """Evict idle sessions of holders over their share, if ``holder`` is within its own (cache_policy)."""
        now = time.monotonic()
        held = [
            Holding(s.session_id, s.holder, s.slots, now - s.last_used, s.lock.locked())
            for s in self.sessions.values()
            if s is not exclude
        ]
        if exclude is not None:
            held.append(Holding(exclude.session_id, exclude.holder, exclude.slots, 0.0, True))
        share = int(self.peer_share * self.max_tokens)
        for session_id in choose_victims(held, holder, slots, slots - self.tokens_left, share, self.evict_idle_after):
            self.evict(session_id)

    def evict(self, session_id: str) -> None:
        """Take a session's cache away for someone else's room: its stream's next step is refused with
        ``SessionEvictedError`` (``check_not_evicted``), and its client re-opens it elsewhere."""
        cache = self.sessions.get(session_id)
        if cache is None:
            return
        self.free(session_id)
        cache.evicted = True
        self.evictions += 1
        self.evicted_ids[session_id] = None
        if len(self.evicted_ids) > REMEMBERED_EVICTIONS:
            self.evicted_ids.popitem(last=False)

    def check_not_evicted(self, cache: SessionCache) -> None:
        if cache.evicted:
            raise SessionEvictedError(
                f"session {cache.session_id[:80]!r} was evicted to make room for other peers (the server was full "
                "and its holder over its share of the cache); open it again, here later or elsewhere"
            )

    def idle_limit(self, idle_timeout: float) -> float:
        """How long a stream may sit idle now (shorter while the cache is nearly full; cache_policy)."""
        free, total = self.tokens_left, self.max_tokens
        return idle_limit(idle_timeout, self.pressure_idle_timeout, free, total, self.pressure_free)

    def release(self, session_id: str, keep: bool, cache: SessionCache | None = None) -> None:
        """End a stream's hold on a session: keep it detached for the TTL, or free it now (``cache``: only if
        the id still names that session — an evicted one's id may have been opened again)."""
        held = self.sessions.get(session_id)
        if held is None or (cache is not None and held is not cache):
            return
        cache = held
        if keep and self.session_ttl > 0:
            self._detach(cache)
            cache.touch()
        else:
            self.free(session_id)

    def free(self, session_id: str) -> None:
        cache = self.sessions.pop(session_id, None)
        if cache is not None:
            self._detach(cache)
            self.used_slots -= cache.slots
            cache.kv = []
            cache.capacity = 0

    def expire(self) -> int:
        now = time.monotonic()
        stale = [
            s.session_id for s in self.sessions.values() if not s.attached and now - s.last_used > self.session_ttl
        ]
        for session_id in stale:
            self.free(session_id)
        return len(stale)

    def stats(self) -> dict:
        return {
            "cache_tokens_total": self.max_tokens,
            "cache_tokens_used": self.used_slots,
            "cache_tokens_left": self.tokens_left,
            "sessions_attached": sum(1 for s in self.sessions.values() if s.attached),
            "sessions_detached": sum(1 for s in self.sessions.values() if not s.attached),
            "sessions_evicted": self.evictions,
        }
