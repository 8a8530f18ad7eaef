"""The capacity line's reservations shared by gateway replicas, through Redis.

Each replica of one gateway service (one Redis, one swarm) publishes how many KV-cache token slots its
running requests reserved (``CapacityQueue.reserved_tokens``) and reads the sum of everyone else's, so a
replica admits a big request only while the reservations of *all* replicas leave room for it — the same
line as one gateway, not N lines that each think the swarm's cache is theirs.

Keys, under ``swarmserve:reservations:<namespace>`` (the namespace of the affinity records: one per swarm and
model): a hash replica → reserved tokens and a sorted set replica → expiry (ms, Redis's own clock, so the
replicas' clocks need not agree). An entry lives ``ttl_s`` after its replica's last publish: a replica that
died stops holding its share within ``ttl_s`` (its sessions on the servers end too). Every publish drops
expired entries and renews the two keys' own expiry, so nothing outlives the last live replica by more than
``ttl_s`` and the hash holds at most one entry per live replica.

Reservations are advisory, as within one gateway: two replicas admitting in the same instant may both fit on
their own and together not; the servers' own answer (room or ``SwarmBusyError``) then decides, as it does for
a request that states no need. A Redis that fails leaves each replica with its own reservations only (logged
once per outage), never a failed request.
"""

from __future__ import annotations

import logging
from typing import Any

from gateway.redis_client import LazyRedis

__all__ = ["RedisReservations"]

logger = logging.getLogger(__name__)

# KEYS[1]: hash replica -> tokens; KEYS[2]: zset replica -> expiry (ms)
# ARGV[1]: this replica, ARGV[2]: its reserved tokens (0: none), ARGV[3]: ttl (ms)
# returns the other live replicas' reserved tokens, summed
_PUBLISH_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
local stale = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, replica in ipairs(stale) do redis.call('HDEL', KEYS[1], replica) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if tonumber(ARGV[2]) > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
else
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
end
local others = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] then others = others + tonumber(all[i + 1]) end
end
if #all > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return others
"""


class RedisReservations:
    """This replica's entry on the shared board: ``publish`` writes it and answers everyone else's sum."""

    def __init__(
        self, url: str, namespace: str, replica_id: str, *, ttl_s: float = 10.0, socket_timeout_s: float = 1.0
    ):
        self.replica_id = replica_id
        self.ttl_s = ttl_s
        prefix = f"swarmserve:reservations:{namespace}"
        # the hash tag keeps both keys in one Redis Cluster slot (a script may only touch one)
        self.keys = [f"{prefix}:{{tokens}}", f"{prefix}:{{tokens}}:expiry"]
        self._client = LazyRedis(url, socket_timeout_s)
        self._script: Any = None
        self._failing = False

    async def publish(self, reserved_tokens: int) -> int:
        """Write this replica's reserved tokens (0 removes its entry); the other live replicas' sum, or 0 while
        Redis fails."""
        try:
            if self._script is None:
                self._script = self._client.get().register_script(_PUBLISH_SCRIPT)
            others = await self._script(
                keys=self.keys, args=[self.replica_id, max(0, int(reserved_tokens)), int(self.ttl_s * 1000)]
            )
        except Exception as exc:  # redis.exceptions.RedisError, OSError, a timeout
            if not self._failing:
                logger.warning(
                    "capacity line: Redis at %s failed (%s); reservations are this replica's own until it answers",
                    self._client.url,
                    exc,
                )
            self._failing = True
            self._script = None  # made again on the next client
            return 0
        if self._failing:
            logger.info("capacity line: Redis answers again; reservations are shared by the replicas")
            self._failing = False
        return int(others)

    async def aclose(self) -> None:
        await self._client.aclose()
