"""Session affinity: which server-side KV caches hold which token sequences, so a follow-up request resumes
them and sends the servers only its new tokens.

A *record* describes one session whose caches the servers keep after its request ended (workers keep a
finished session for ``--session-ttl`` seconds): the backend's exported state (for the swarm: the peer id
and server session id of every hop, ``InferenceSession.export_state()``), the token ids the caches hold,
the replica that wrote it, and when. Any replica can resume it: the state names the servers directly.

Keys (one namespace per served model, ``swarmserve:affinity:<hash>``; the same layout in memory and Redis):

- ``{ns}:rec:{rid}`` → the record as JSON, expiring after ``ttl_s`` (the servers' session TTL).
- ``{ns}:pfx:{h_k}`` → ``rid`` for every ``k`` with ``k·B ≤ len(tokens)``: the record indexed under the
  hash of each of its ``B``-token-aligned prefixes (``B = block_tokens``). Hashes chain,
  ``h_k = blake2b(h_{k-1} ‖ tokens[(k-1)B : kB])``, so all of a prompt's hashes cost one pass.

Lookup. A request names its session (``X-Session-Id`` or ``user``): then its record is ``k:<hash of the
key>``, private to that key and not indexed. Otherwise the prompt's own prefix hashes are looked up, deepest
first, in one ``MGET``: in a chat, the prompt of turn N+1 starts with the prompt and completion of turn N,
so the deepest hit is this conversation's previous turn. Hits are verified on the token ids (a record may
have moved on since its entries were written; a hash may collide), the exact common prefix counted, and a
record is taken only if ``common ≥ B`` and ``common ≥ len(record) − common``: resuming rolls the caches back
to ``common``, destroying the record's tail, so a conversation that merely shares a system prompt with
another one (a sibling, not a continuation) starts its own session instead of thrashing the other's — unless
the shared part is worth more than what it would destroy.

Claiming is taking. A request *removes* the record it resumes (``GETDEL``: atomic in Redis, a ``pop`` in
memory) and writes it back, with its new state and tokens, after its session was closed with the caches
kept. So two concurrent requests never drive one server session — the second finds nothing and starts a
fresh session (no reuse, no waiting) — and a record can never describe caches someone changed since: a
request that fails, or whose write-back fails (Redis gone), leaves no record, and its caches expire on the
servers. Locks with expiry (``SET NX PX``) would leave a stale record behind exactly in those cases.

Failure: ``RedisAffinityStore`` treats an unreachable Redis as "no record" and "not saved": requests keep
being served without reuse. It logs the outage once, skips Redis for ``retry_interval_s`` at a time instead
of paying a connection timeout per request, and logs once more when Redis answers again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

__all__ = [
    "AffinityRecord",
    "AffinityStore",
    "Claim",
    "InMemoryAffinityStore",
    "RedisAffinityStore",
    "StoreUnavailable",
    "common_prefix",
    "create_store",
    "prefix_hashes",
]

T = TypeVar("T")

#: tokens per indexed prefix block: finer finds more, costs one index key per block per record
DEFAULT_BLOCK_TOKENS = 16
#: index hits tried per lookup (each is one record read)
MAX_CANDIDATES = 4


class StoreUnavailable(Exception):
    """The store cannot be reached right now; callers serve without reuse."""


# ------------------------------------------------------------------------------------------ pure functions


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def prefix_hashes(token_ids: Sequence[int], block_tokens: int, salt: bytes = b"") -> list[str]:
    """``[h_1, h_2, …]``: the chained hash of ``token_ids[:k·B]`` for every whole block ``k``."""
    out: list[str] = []
    digest = hashlib.blake2b(salt, digest_size=16).digest()
    for end in range(block_tokens, len(token_ids) + 1, block_tokens):
        block = token_ids[end - block_tokens : end]
        digest = hashlib.blake2b(digest + struct.pack(f"<{block_tokens}I", *block), digest_size=16).digest()
        out.append(digest.hex())
    return out


def worth_taking(common: int, record_tokens: int, block_tokens: int) -> bool:
    """Resume a record found by prefix only if it saves at least one block and at least as many tokens as
    the rollback destroys (see the module docstring)."""
    return common >= block_tokens and common >= record_tokens - common


# ------------------------------------------------------------------------------------------------- records


@dataclass
class AffinityRecord:
    """One resumable session: what is cached where."""

    rid: str
    #: the backend's state to resume from (JSON-able; the swarm's: hops with peer and server session ids)
    state: dict[str, Any]
    #: the tokens whose keys and values the caches hold, in order
    token_ids: list[int]
    #: the gateway replica that wrote the record (informational: any replica can resume it)
    replica: str
    #: unix time of the write
    last_used: float = field(default_factory=time.time)
    keyed: bool = False

    @property
    def cached_tokens(self) -> int:
        return len(self.token_ids)

    def to_json(self) -> str:
        return json.dumps(
            {
                "rid": self.rid,
                "replica": self.replica,
                "last_used": self.last_used,
                "keyed": self.keyed,
                "cached_tokens": self.cached_tokens,
                "state": self.state,
                "token_ids": self.token_ids,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> AffinityRecord:
        data = json.loads(text)
        return cls(
            rid=str(data["rid"]),
            state=dict(data["state"]),
            token_ids=[int(t) for t in data["token_ids"]],
            replica=str(data.get("replica", "")),
            last_used=float(data.get("last_used", 0.0)),
            keyed=bool(data.get("keyed", False)),
        )


@dataclass
class Claim:
    """A request's hold on a record id: the record it took (None: nothing to resume, start afresh) and the
    tokens that record shares with the prompt. ``save`` writes the session back under ``rid``."""

    rid: str
    keyed: bool
    record: AffinityRecord | None = None
    common: int = 0


# --------------------------------------------------------------------------------------------------- store


class AffinityStore(ABC):
    """Lookup, claim and write-back of session records over a few key-value primitives that the two
    implementations provide (``InMemoryAffinityStore``, ``RedisAffinityStore``)."""

    def __init__(
        self,
        *,
        namespace: str,
        ttl_s: float = 300.0,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        max_candidates: int = MAX_CANDIDATES,
    ):
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.ns = f"swarmserve:affinity:{hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()}"
        self.ttl_s = ttl_s
        self.block_tokens = block_tokens
        self.max_candidates = max_candidates
        self._salt = namespace.encode()

    # ------------------------------------------------------------------ keys
    def _rec(self, rid: str) -> str:
        return f"{self.ns}:rec:{rid}"

    def _pfx(self, digest: str) -> str:
        return f"{self.ns}:pfx:{digest}"

    def keyed_rid(self, key: str) -> str:
        return "k:" + hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    # ------------------------------------------------------------------ the API
    async def claim(self, prompt_ids: Sequence[int], key: str | None = None) -> Claim | None:
        """Take the record to resume for ``prompt_ids`` (the key's own record when ``key`` is given).

        Returns a ``Claim`` whose ``record`` is None when there is nothing to resume (a miss, or the match is
        in use by a concurrent request: start a fresh session), or None when the store is unavailable (serve
        without affinity)."""
        try:
            if key is not None:
                return await self._claim_keyed(prompt_ids, key)
            return await self._claim_prefix(prompt_ids)
        except StoreUnavailable:
            return None
        except Exception:  # a corrupt record, a bug: never fail a request over an optimization
            logger.warning("session-affinity lookup failed; serving without reuse", exc_info=True)
            return None

    async def save(self, claim: Claim, state: dict[str, Any], token_ids: Sequence[int], replica: str) -> bool:
        """Write (or write back) the session under ``claim.rid`` and index its prefixes; False if the store is
        unavailable (the servers' caches then simply expire)."""
        record = AffinityRecord(claim.rid, state, list(token_ids), replica, time.time(), claim.keyed)
        items = {self._rec(record.rid): record.to_json()}
        if not claim.keyed:
            for digest in prefix_hashes(record.token_ids, self.block_tokens, self._salt):
                items[self._pfx(digest)] = record.rid
        try:
            await self._set_many(items, self._ttl_ms)
        except StoreUnavailable:
            return False
        except Exception:
            logger.warning("session-affinity write failed; the session will not be reused", exc_info=True)
            return False
        return True

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release connections (Redis); the in-memory store has none."""

    @property
    def available(self) -> bool:
        """Whether the store is believed reachable (the Redis one may be in an outage)."""
        return True

    # ------------------------------------------------------------------ internals
    async def _claim_keyed(self, prompt_ids: Sequence[int], key: str) -> Claim:
        rid = self.keyed_rid(key)
        text = await self._getdel(self._rec(rid))
        if text is None:
            return Claim(rid, keyed=True)
        record = AffinityRecord.from_json(text)
        # the caller said "this is my conversation": resume even if little is shared (rollback is cheap and
        # keeps one server session per key instead of orphaning the old one)
        return Claim(rid, True, record, common_prefix(record.token_ids, prompt_ids))

    async def _claim_prefix(self, prompt_ids: Sequence[int]) -> Claim:
        hashes = prefix_hashes(prompt_ids, self.block_tokens, self._salt)
        fresh = Claim(f"p:{uuid.uuid4().hex}", keyed=False)
        if not hashes:
            return fresh
        hits = await self._mget([self._pfx(h) for h in hashes])
        candidates: list[str] = []
        for rid in reversed(hits):  # deepest prefix first
            if rid is not None and rid not in candidates:
                candidates.append(rid)
                if len(candidates) >= self.max_candidates:
                    break
        if not candidates:
            return fresh
        texts = await self._mget([self._rec(rid) for rid in candidates])
        for rid, text in zip(candidates, texts, strict=True):
            if text is None:  # expired, or in use by a concurrent request
                continue
            seen = AffinityRecord.from_json(text)
            if not worth_taking(
                common_prefix(seen.token_ids, prompt_ids), len(seen.token_ids), self.block_tokens
            ):
                continue
            taken_text = await self._getdel(self._rec(rid))
            if taken_text is None:  # someone took it between the read and now
                continue
            taken = AffinityRecord.from_json(taken_text)
            common = common_prefix(taken.token_ids, prompt_ids)
            if worth_taking(common, len(taken.token_ids), self.block_tokens):
                return Claim(rid, False, taken, common)
            await self._put_back(taken)  # rewritten since the read and no longer a match
        return fresh

    async def _put_back(self, record: AffinityRecord) -> None:
        left_ms = int((self.ttl_s - (time.time() - record.last_used)) * 1000)
        if left_ms > 0:
            await self._set_nx(self._rec(record.rid), record.to_json(), left_ms)

    # ------------------------------------------------------------------ primitives
    @abstractmethod
    async def _mget(self, keys: list[str]) -> list[str | None]: ...

    @abstractmethod
    async def _getdel(self, key: str) -> str | None: ...

    @abstractmethod
    async def _set_many(self, items: dict[str, str], ttl_ms: int) -> None: ...

    @abstractmethod
    async def _set_nx(self, key: str, value: str, ttl_ms: int) -> bool: ...


class InMemoryAffinityStore(AffinityStore):
    """The default without ``--redis-url``: one gateway replica's dict with expiry. Event-loop only (every
    operation completes without awaiting, so each is atomic)."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self._data: dict[str, tuple[str, float]] = {}  # key → (value, monotonic expiry)
        self._next_sweep = 0.0

    def _live(self, key: str, now: float) -> str | None:
        item = self._data.get(key)
        if item is None:
            return None
        if item[1] <= now:
            del self._data[key]
            return None
        return item[0]

    def _sweep(self, now: float) -> None:
        """Drop expired keys now and then, so a busy gateway's dict does not grow without bound."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + max(1.0, self.ttl_s / 10)
        for key in [k for k, (_, expiry) in self._data.items() if expiry <= now]:
            del self._data[key]

    async def _mget(self, keys: list[str]) -> list[str | None]:
        now = time.monotonic()
        return [self._live(k, now) for k in keys]

    async def _getdel(self, key: str) -> str | None:
        value = self._live(key, time.monotonic())
        self._data.pop(key, None)
        return value

    async def _set_many(self, items: dict[str, str], ttl_ms: int) -> None:
        now = time.monotonic()
        self._sweep(now)
        expiry = now + ttl_ms / 1000
        for key, value in items.items():
            self._data[key] = (value, expiry)

    async def _set_nx(self, key: str, value: str, ttl_ms: int) -> bool:
        now = time.monotonic()
        if self._live(key, now) is not None:
            return False
        self._data[key] = (value, now + ttl_ms / 1000)
        return True

    def __len__(self) -> int:
        now = time.monotonic()
        return sum(1 for _, expiry in self._data.values() if expiry > now)


class RedisAffinityStore(AffinityStore):
    """Records shared by every gateway replica through one Redis (``redis.asyncio``).

    The client connects lazily, on the event loop of its first use (uvicorn's). Short socket timeouts and
    a single immediate retry (a pooled connection that died with a restarted Redis is replaced at once)
    keep an outage from stalling requests; see the module docstring for how outages are handled.
    """

    def __init__(
        self,
        url: str,
        *,
        retry_interval_s: float = 1.0,
        socket_timeout_s: float = 1.0,
        **kw: Any,
    ):
        super().__init__(**kw)
        self.url = url
        self.retry_interval_s = retry_interval_s
        self.socket_timeout_s = socket_timeout_s
        self._client: Any = None
        self._down = False
        self._retry_at = 0.0

    @property
    def available(self) -> bool:
        return not self._down

    def _redis(self) -> Any:
        if self._client is None:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            self._client = aioredis.Redis.from_url(
                self.url,
                decode_responses=True,
                socket_timeout=self.socket_timeout_s,
                socket_connect_timeout=self.socket_timeout_s,
                retry=Retry(NoBackoff(), 1),
            )
        return self._client

    async def _io(self, op: Callable[[Any], Awaitable[T]]) -> T:
        """Run one Redis operation; any Redis failure (unreachable, but also OOM, READONLY, auth) makes the
        store unavailable for ``retry_interval_s``: logged once per outage, never per request."""
        from redis.exceptions import RedisError

        if self._down and time.monotonic() < self._retry_at:
            raise StoreUnavailable(f"redis at {self.url} is unreachable")
        try:
            result = await op(self._redis())
        except (RedisError, OSError) as exc:
            if not self._down:
                logger.warning(
                    "session-affinity store: Redis at %s is unreachable (%s); serving without KV-cache reuse "
                    "until it is back",
                    self.url,
                    exc,
                )
            self._down = True
            self._retry_at = time.monotonic() + self.retry_interval_s
            raise StoreUnavailable(str(exc)) from exc
        if self._down:
            self._down = False
            logger.warning(
                "session-affinity store: Redis at %s is reachable again; KV-cache reuse resumes", self.url
            )
        return result

    async def _mget(self, keys: list[str]) -> list[str | None]:
        return await self._io(lambda r: r.mget(keys))

    async def _getdel(self, key: str) -> str | None:
        return await self._io(lambda r: r.getdel(key))

    async def _set_many(self, items: dict[str, str], ttl_ms: int) -> None:
        async def write(r: Any) -> None:
            pipe = r.pipeline(transaction=False)
            for key, value in items.items():
                pipe.set(key, value, px=ttl_ms)
            await pipe.execute()

        await self._io(write)

    async def _set_nx(self, key: str, value: str, ttl_ms: int) -> bool:
        return bool(await self._io(lambda r: r.set(key, value, px=ttl_ms, nx=True)))

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.aclose()
            except Exception:  # closing a client whose server is gone
                logger.debug("closing the Redis client failed", exc_info=True)


def create_store(
    *,
    redis_url: str | None,
    namespace: str,
    ttl_s: float,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> AffinityStore:
    """Redis when a URL is given (replicas share it), else this process's memory."""
    if redis_url:
        return RedisAffinityStore(redis_url, namespace=namespace, ttl_s=ttl_s, block_tokens=block_tokens)
    return InMemoryAffinityStore(namespace=namespace, ttl_s=ttl_s, block_tokens=block_tokens)
