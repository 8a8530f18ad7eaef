"""One lazily made asyncio Redis client, as the gateway's Redis-backed stores use it (session affinity,
stored responses): made on the event loop of its first use (uvicorn's), short socket timeouts so a Redis
that went away fails a request instead of hanging it, one retry for a pooled connection that died with a
restarted Redis, and a close that tolerates a server already gone."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["LazyRedis"]

logger = logging.getLogger(__name__)


class LazyRedis:
    def __init__(self, url: str, socket_timeout_s: float, *, decode_responses: bool = False):
        self.url = url
        self.socket_timeout_s = socket_timeout_s
        self.decode_responses = decode_responses
        self._client: Any = None

    def get(self) -> Any:
        """The client (``redis.asyncio.Redis``), made on first use."""
        if self._client is None:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            self._client = aioredis.Redis.from_url(
                self.url,
                decode_responses=self.decode_responses,
                socket_timeout=self.socket_timeout_s,
                socket_connect_timeout=self.socket_timeout_s,
                retry=Retry(NoBackoff(), 1),
            )
        return self._client

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.aclose()
            except Exception:  # closing a client whose server is gone
                logger.debug("closing the Redis client failed", exc_info=True)
