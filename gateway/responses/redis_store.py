"""``RedisResponsesStore``: the stored responses of ``/v1/responses`` in one Redis, so that a follow-up
(``previous_response_id``), ``GET`` and ``DELETE`` work on whichever gateway replica they reach.

Keys, under ``swarmserve:responses:<namespace>`` (the namespace of the affinity records: one per swarm and
model):

- ``…:r:<id>`` — the encoded entry (gateway/responses/store.py), with ``ttl_s`` as its Redis expiry, so Redis
  itself forgets it;
- ``…:o:<owner>`` — a sorted set of the owner's ids by creation time, itself expiring ``ttl_s`` after the
  owner's last entry: on every put, ids past their TTL leave it, and beyond ``max_per_owner`` the oldest go
  (their entries deleted with them).

An entry over ``max_entry_bytes`` is not written. Every call is ``redis.asyncio`` on the event loop with short
socket timeouts; a Redis that cannot be reached is a 503 with Retry-After for the request that needed it
(never a silent 404: the entry may well exist).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from gateway.errors import ServiceUnavailableError
from gateway.redis_client import LazyRedis
from gateway.responses.store import (
    DEFAULT_MAX_ENTRY_BYTES,
    DEFAULT_MAX_PER_OWNER,
    DEFAULT_TTL_S,
    StoredResponse,
    decode_entry,
    encode_entry,
)

logger = logging.getLogger(__name__)

__all__ = ["RedisResponsesStore"]

T = TypeVar("T")


class RedisResponsesStore:
    """Entries shared by every replica through Redis; bounded by TTL, entry size and count per owner."""

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        max_per_owner: int = DEFAULT_MAX_PER_OWNER,
        socket_timeout_s: float = 2.0,
    ):
        if ttl_s <= 0 or max_entry_bytes < 1 or max_per_owner < 1:
            raise ValueError("a responses store needs ttl_s, max_entry_bytes and max_per_owner > 0")
        self.url = url
        self.prefix = f"swarmserve:responses:{namespace}"
        self.ttl_s = ttl_s
        self.max_entry_bytes = max_entry_bytes
        self.max_per_owner = max_per_owner
        self.socket_timeout_s = socket_timeout_s
        self._client = LazyRedis(url, socket_timeout_s)

    async def _io(self, op: Callable[[Any], Awaitable[T]]) -> T:
        from redis.exceptions import RedisError

        try:
            return await op(self._client.get())
        except (RedisError, OSError) as exc:
            logger.warning("responses store: Redis at %s failed: %s", self.url, exc)
            raise ServiceUnavailableError(
                "The stored responses cannot be reached right now (their Redis is unavailable); try again."
            ) from exc

    def _entry_key(self, response_id: str) -> str:
        return f"{self.prefix}:r:{response_id}"

    def _owner_key(self, owner: str | None) -> str:
        return f"{self.prefix}:o:{owner or '-'}"

    async def put(self, entry: StoredResponse) -> bool:
        data = await encode_entry(entry)
        if len(data) > self.max_entry_bytes:
            return False
        ttl_ms = int(self.ttl_s * 1000)
        now = time.time()
        owner_key = self._owner_key(entry.owner)

        async def write(r: Any) -> list[bytes]:
            pipe = r.pipeline(transaction=True)
            pipe.set(self._entry_key(entry.id), data, px=ttl_ms)
            pipe.zadd(owner_key, {entry.id: now})
            pipe.zremrangebyscore(owner_key, "-inf", now - self.ttl_s)
            pipe.pexpire(owner_key, ttl_ms)
            pipe.zcard(owner_key)
            count = (await pipe.execute())[-1]
            if count <= self.max_per_owner:
                return []
            evicted = [member for member, _ in await r.zpopmin(owner_key, count - self.max_per_owner)]
            if evicted:
                await r.delete(*[self._entry_key(m.decode()) for m in evicted])
            return evicted

        await self._io(write)
        return True

    async def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        data = await self._io(lambda r: r.get(self._entry_key(response_id)))
        if data is None:
            return None
        entry = await decode_entry(data)
        return entry if entry.owner == owner else None

    async def delete(self, response_id: str, owner: str | None) -> bool:
        if await self.get(response_id, owner) is None:
            return False

        async def remove(r: Any) -> None:
            pipe = r.pipeline(transaction=True)
            pipe.delete(self._entry_key(response_id))
            pipe.zrem(self._owner_key(owner), response_id)
            await pipe.execute()

        await self._io(remove)
        return True

    async def aclose(self) -> None:
        await self._client.aclose()
