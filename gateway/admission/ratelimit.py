"""Per-key rate limits on the generation routes: requests per minute and tokens per minute.

A request costs 1 request and an estimate of its tokens taken before it runs, as OpenAI does: its prompt
tokens (counted with the served model's tokenizer, or a tiktoken BPE file) plus its completion budget
(``max_completion_tokens``/``max_tokens``, else ``default_max_tokens``) times its choices. Over a limit it
is a 429 in OpenAI's envelope, code ``rate_limit_exceeded``, with ``Retry-After`` in whole seconds (when
the request would fit, assuming no other traffic) and OpenAI's ``x-ratelimit-*`` headers.

Counting: a sliding-window counter over fixed one-minute windows, ``estimate = previous window × (1 −
elapsed / window) + current window`` — smooth like a sliding log, two integers per limit and key. With
``redis_url`` the counters live in Redis, checked and bumped by one Lua script (atomic, one round trip, on
Redis's own clock), so every gateway replica shares them; without it, in this process. While Redis is
unreachable each replica falls back to its own in-memory counters (logged once) and retries Redis after
``retry_interval_s``: limits loosen to per-replica instead of failing requests or failing open.

The key is the API key id the auth middleware left (``scope["state"]["api_key_id"]``); on an open gateway,
the client's address (behind a proxy named in ``trusted_proxies``, from its ``X-Forwarded-For``) — never an
unverified bearer token: a made-up token per request would be a fresh budget per request.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.datastructures import Headers
from starlette.types import Scope

from gateway.admission.token_estimates import (
    CHAT_PATH,
    CL100K_PATTERN,
    COMPLETIONS_PATH,
    RESPONSES_PATH,
    ModelTokenCounter,
    TiktokenCounter,
    TokenCounter,
    estimate_tokens,
    read_tiktoken_bpe,
)
from gateway.errors import GatewayError

logger = logging.getLogger(__name__)

__all__ = [
    "CL100K_PATTERN",
    "GENERATION_PATHS",
    "Decision",
    "MemoryWindowStore",
    "ModelTokenCounter",
    "RateLimitError",
    "RateLimiter",
    "RedisWindowStore",
    "TiktokenCounter",
    "TokenCounter",
    "estimate_tokens",
    "read_tiktoken_bpe",
    "client_address",
    "request_identity",
    "wait_seconds",
]

GENERATION_PATHS = frozenset({CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH})
WINDOW_S = 60.0


class RateLimitError(GatewayError):
    status_code = 429
    type = "requests"  # OpenAI's type for rate-limit errors
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int, extra_headers: Mapping[str, str] = ()):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.extra_headers = dict(extra_headers)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s), **self.extra_headers}


# ---------------------------------------------------------------------------------------- window counting


def wait_seconds(prev: float, curr: float, elapsed: float, window: float, cost: float, limit: float) -> float:
    """How long until ``cost`` fits under ``limit`` if nothing else is counted meanwhile (0: it fits now;
    ``inf``: never, ``cost > limit``). ``prev``/``curr``: counts of the previous and current fixed window,
    ``elapsed``: seconds into the current one; the estimate is ``prev × (1 − elapsed/window) + curr``."""
    if cost > limit:
        return math.inf
    if prev * (1 - elapsed / window) + curr + cost <= limit:
        return 0.0
    if curr + cost <= limit:  # fits once enough of the previous window has slid out
        return max(0.0, window * (1 - (limit - curr - cost) / prev) - elapsed)
    # only in the next window, where this window's count becomes the one sliding out
    rest = window - elapsed
    return rest + max(0.0, window * (1 - (limit - cost) / curr)) if curr > 0 else rest


@dataclass(frozen=True)
class Counts:
    """What a store saw: per limit name, (previous window, current window) counts before this request."""

    admitted: bool
    elapsed: float
    windows: dict[str, tuple[float, float]]


#: name → (limit, cost) of one request
Costs = Mapping[str, tuple[int, int]]


class WindowStore(Protocol):
    async def hit(self, identity: str, costs: Costs, window: float) -> Counts:
        """Admit (and count) the request if every ``prev × weight + curr + cost <= limit``; atomic."""

    async def aclose(self) -> None: ...


class MemoryWindowStore:
    """Counters in this process (one replica). The event loop serializes ``hit``: no lock needed."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        #: (identity, name) → {window index: count}
        self._counts: dict[tuple[str, str], dict[int, int]] = {}
        self._hits = 0

    async def hit(self, identity: str, costs: Costs, window: float) -> Counts:
        now = self.clock()
        idx = math.floor(now / window)
        elapsed = now - idx * window
        weight = 1 - elapsed / window
        windows, admitted = {}, True
        for name, (limit, cost) in costs.items():
            counts = self._counts.get((identity, name), {})
            prev, curr = counts.get(idx - 1, 0), counts.get(idx, 0)
            windows[name] = (float(prev), float(curr))
            if prev * weight + curr + cost > limit:
                admitted = False
        if admitted:
            for name, (_, cost) in costs.items():
                counts = self._counts.setdefault((identity, name), {})
                counts[idx] = counts.get(idx, 0) + cost
                for old in [i for i in counts if i < idx - 1]:
                    del counts[old]
        self._hits += 1
        if self._hits % 1024 == 0:  # keys that stopped coming
            for k in [k for k, c in self._counts.items() if not c or max(c) < idx - 1]:
                del self._counts[k]
        return Counts(admitted, elapsed, windows)

    async def aclose(self) -> None:
        pass


# KEYS[1]: prefix; ARGV[1]: window seconds; then (name, limit, cost) triples. Redis's clock, so replicas
# agree on the window whatever their own clocks say (writes after TIME need Redis >= 5: effects replication).
# Numbers go back as strings (Lua numbers would be truncated to integers on the way out).
_HIT_SCRIPT = """
local prefix, window = KEYS[1], tonumber(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local idx = math.floor(now / window)
local elapsed = now - idx * window
local weight = 1 - elapsed / window
local admitted = 1
local out = {}
for i = 2, #ARGV, 3 do
  local base = prefix .. ':' .. ARGV[i] .. ':'
  local prev = tonumber(redis.call('GET', base .. string.format('%d', idx - 1)) or '0')
  local curr = tonumber(redis.call('GET', base .. string.format('%d', idx)) or '0')
  if prev * weight + curr + tonumber(ARGV[i + 2]) > tonumber(ARGV[i + 1]) then admitted = 0 end
  table.insert(out, tostring(prev))
  table.insert(out, tostring(curr))
end
if admitted == 1 then
  for i = 2, #ARGV, 3 do
    local key = prefix .. ':' .. ARGV[i] .. ':' .. string.format('%d', idx)
    redis.call('INCRBY', key, ARGV[i + 2])
    redis.call('PEXPIRE', key, math.ceil(window * 2000))
  end
end
table.insert(out, 1, tostring(elapsed))
table.insert(out, 1, admitted)
return out
"""


class RedisWindowStore:
    """Counters in Redis, shared by every replica that uses the same Redis and ``key_prefix``."""

    def __init__(self, url: str, key_prefix: str = "swarmserve:ratelimit", timeout_s: float = 1.0):
        import redis.asyncio as aioredis

        self.key_prefix = key_prefix
        self.redis = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._script = self.redis.register_script(_HIT_SCRIPT)

    async def hit(self, identity: str, costs: Costs, window: float) -> Counts:
        args: list[Any] = [window]
        for name, (limit, cost) in costs.items():
            args += [name, limit, cost]
        # the hash tag keeps one key's counters in one Redis Cluster slot
        raw = await self._script(keys=[f"{self.key_prefix}:{{{identity}}}"], args=args)
        admitted, elapsed, *counts = raw
        windows = {name: (float(counts[2 * i]), float(counts[2 * i + 1])) for i, name in enumerate(costs)}
        return Counts(int(admitted) == 1, float(elapsed), windows)

    async def aclose(self) -> None:
        await self.redis.aclose()


@dataclass(frozen=True)
class Decision:
    admitted: bool
    #: seconds until the request would fit (0 when admitted; inf when it never can)
    retry_after_s: float
    #: the limit that refused it: "requests" or "tokens"
    refused_by: str | None
    #: name → (limit, remaining after this request)
    remaining: dict[str, tuple[int, int]]

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-limit-*`` / ``x-ratelimit-remaining-*`` response headers."""
        out = {}
        for name, (limit, remaining) in self.remaining.items():
            out[f"x-ratelimit-limit-{name}"] = str(limit)
            out[f"x-ratelimit-remaining-{name}"] = str(remaining)
        return out


class RateLimiter:
    """Checks and counts requests against ``rpm``/``tpm`` (0 = that limit is off) per identity."""

    def __init__(
        self,
        rpm: int = 0,
        tpm: int = 0,
        *,
        redis_url: str | None = None,
        window_s: float = WINDOW_S,
        retry_interval_s: float = 10.0,
        memory: MemoryWindowStore | None = None,
    ):
        self.rpm, self.tpm, self.window_s = rpm, tpm, window_s
        self.memory = memory or MemoryWindowStore()
        self.redis = RedisWindowStore(redis_url) if redis_url else None
        self.retry_interval_s = retry_interval_s
        self._redis_down_until = 0.0

    @property
    def enabled(self) -> bool:
        return self.rpm > 0 or self.tpm > 0

    async def check(self, identity: str, tokens: int) -> Decision:
        costs: dict[str, tuple[int, int]] = {}
        if self.rpm > 0:
            costs["requests"] = (self.rpm, 1)
        if self.tpm > 0:
            costs["tokens"] = (self.tpm, tokens)
        counts = await self._hit(identity, costs)
        weight = 1 - counts.elapsed / self.window_s
        remaining, waits = {}, {}
        for name, (limit, cost) in costs.items():
            prev, curr = counts.windows[name]
            used = prev * weight + curr + (cost if counts.admitted else 0)
            remaining[name] = (limit, max(0, math.floor(limit - used)))
            waits[name] = wait_seconds(prev, curr, counts.elapsed, self.window_s, cost, limit)
        if counts.admitted:
            return Decision(True, 0.0, None, remaining)
        refused_by = max(waits, key=lambda n: waits[n])
        return Decision(False, waits[refused_by], refused_by, remaining)

    async def _hit(self, identity: str, costs: Costs) -> Counts:
        if self.redis is not None and time.monotonic() >= self._redis_down_until:
            try:
                counts = await self.redis.hit(identity, costs, self.window_s)
            except Exception as exc:  # redis-py raises RedisError and OSError subclasses for an outage
                if self._redis_down_until == 0.0:
                    logger.warning("rate limiter: Redis unreachable (%s); counting in this replica", exc)
                self._redis_down_until = time.monotonic() + self.retry_interval_s
            else:
                if self._redis_down_until:
                    logger.warning("rate limiter: Redis is back; counters are shared again")
                    self._redis_down_until = 0.0
                return counts
        return await self.memory.hit(identity, costs, self.window_s)

    async def aclose(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()

    def refusal(self, decision: Decision, tokens: int) -> RateLimitError:
        """The 429 for a refused ``decision`` of a request estimated at ``tokens``."""
        headers = decision.headers()
        if decision.refused_by == "tokens":
            if math.isinf(decision.retry_after_s):
                return RateLimitError(
                    f"Request too large: tokens per min (TPM) limit {self.tpm}, requested {tokens}. "
                    "Send fewer prompt tokens or a smaller max_tokens.",
                    retry_after_s=math.ceil(self.window_s),
                    extra_headers=headers,
                )
            what = f"tokens per min (TPM): limit {self.tpm}, requested {tokens}"
        else:
            what = f"requests per min (RPM): limit {self.rpm}"
        retry = max(1, math.ceil(decision.retry_after_s))
        return RateLimitError(
            f"Rate limit reached for {what}. Please try again in {retry}s.",
            retry_after_s=retry,
            extra_headers=headers,
        )


def request_identity(scope: Scope, trusted_proxies: Collection[str] = ()) -> str:
    """Whose budget a request spends (see the module docstring): a verified API key, else the client's
    address — never an unverified bearer token, which a client could change to reset its budget."""
    key = scope.get("state", {}).get("api_key_id")
    if key:
        return f"key:{key}"
    return f"ip:{client_address(scope, trusted_proxies)}"


def client_address(scope: Scope, trusted_proxies: Collection[str] = ()) -> str:
    """The client's address: the peer's, or — when the peer is one of ``trusted_proxies`` — the nearest
    address in ``X-Forwarded-For`` that is not a trusted proxy (anything further left the client wrote)."""
    client = scope.get("client")
    address = client[0] if client else "unknown"
    if address not in trusted_proxies:
        return address
    forwarded = Headers(scope=scope).get("x-forwarded-for", "")
    for hop in reversed([h.strip() for h in forwarded.split(",") if h.strip()]):
        if hop not in trusted_proxies:
            return hop[:64]
    return address
