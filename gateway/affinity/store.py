"""The session-affinity store's logic — lookup, claim and write-back of records (``AffinityStore``) over a
few key-value primitives — and its in-memory implementation. The design is in ``gateway/affinity/sessions.py``'s
docstring; the Redis implementation is ``gateway/affinity/redis_store.py``."""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from gateway.affinity.records import (
    DEFAULT_BLOCK_TOKENS,
    MAX_CANDIDATES,
    AffinityRecord,
    Claim,
    StoreUnavailable,
    common_prefix,
    prefix_hashes,
    worth_taking,
)

logger = logging.getLogger(__name__)

__all__ = ["AffinityStore", "InMemoryAffinityStore"]


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

    def keyed_rid(self, key: str, owner: str = "") -> str:
        return "k:" + hashlib.blake2b(f"{owner}\0{key}".encode(), digest_size=16).hexdigest()

    def _owner_salt(self, owner: str) -> bytes:
        """The prefix index's salt for ``owner``: the same prompt under two owners hashes apart, so one can
        neither resume the other's cache nor learn from ``cached_tokens`` how much of a guess it matched."""
        return self._salt + b"\0" + owner.encode()

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    # ------------------------------------------------------------------ the API
    async def claim(
        self, prompt_ids: Sequence[int], key: str | None = None, owner: str = "", adapter: str | None = None
    ) -> Claim | None:
        """Take the record to resume for ``prompt_ids`` (the key's own record when ``key`` is given), among
        ``owner``'s records of sessions that ran the LoRA ``adapter`` (None: the base model) only: a cache
        computed with other weights is never resumed, and a conversation keeps one record per adapter.

        Returns a ``Claim`` whose ``record`` is None when there is nothing to resume (a miss, or the match is
        in use by a concurrent request: start a fresh session), or None when the store is unavailable (serve
        without affinity)."""
        if adapter is not None:  # the adapter's records live apart, as another owner's do (base: as before)
            owner = f"{owner}\0adapter\0{adapter}"
        try:
            if key is not None:
                return await self._claim_keyed(prompt_ids, key, owner)
            return await self._claim_prefix(prompt_ids, owner)
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
            for digest in prefix_hashes(record.token_ids, self.block_tokens, self._owner_salt(claim.owner)):
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
    async def _claim_keyed(self, prompt_ids: Sequence[int], key: str, owner: str) -> Claim:
        rid = self.keyed_rid(key, owner)
        text = await self._getdel(self._rec(rid))
        if text is None:
            return Claim(rid, keyed=True, owner=owner)
        record = AffinityRecord.from_json(text)
        # the caller said "this is my conversation": resume even if little is shared (rollback is cheap and
        # keeps one server session per key instead of orphaning the old one)
        return Claim(rid, True, record, common_prefix(record.token_ids, prompt_ids), owner)

    async def _claim_prefix(self, prompt_ids: Sequence[int], owner: str) -> Claim:
        hashes = prefix_hashes(prompt_ids, self.block_tokens, self._owner_salt(owner))
        fresh = Claim(f"p:{uuid.uuid4().hex}", keyed=False, owner=owner)
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
                return Claim(rid, False, taken, common, owner)
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
