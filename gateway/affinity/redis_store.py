"""``RedisAffinityStore``: session-affinity records shared by every gateway replica through one Redis. The
design, and how a Redis outage is handled, are in ``gateway/affinity/sessions.py``'s docstring."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from gateway.affinity.records import StoreUnavailable
from gateway.affinity.store import AffinityStore
from gateway.redis_client import LazyRedis

logger = logging.getLogger(__name__)

__all__ = ["RedisAffinityStore"]

T = TypeVar("T")


class RedisAffinityStore(AffinityStore):
    """Records shared by every gateway replica through one Redis (``redis.asyncio``).

    The client connects lazily, on the event loop of its first use (uvicorn's). Short socket timeouts and
    a single immediate retry (a pooled connection that died with a restarted Redis is replaced at once)
    keep an outage from stalling requests; ``gateway/affinity/sessions.py`` says how outages are handled.
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
        self._client = LazyRedis(url, socket_timeout_s, decode_responses=True)
        self._down = False
        self._retry_at = 0.0

    @property
    def available(self) -> bool:
        return not self._down

    async def _io(self, op: Callable[[Any], Awaitable[T]]) -> T:
        """Run one Redis operation; any Redis failure (unreachable, but also OOM, READONLY, auth) makes the
        store unavailable for ``retry_interval_s``: logged once per outage, never per request."""
        from redis.exceptions import RedisError

        if self._down and time.monotonic() < self._retry_at:
            raise StoreUnavailable(f"redis at {self.url} is unreachable")
        try:
            result = await op(self._client.get())
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
        await self._client.aclose()
