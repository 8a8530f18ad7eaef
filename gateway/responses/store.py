"""Stored responses of ``POST /v1/responses`` (``store: true``, the default): what ``previous_response_id``
continues and ``GET``/``DELETE /v1/responses/{id}`` read.

Each entry keeps the response as it was sent, the conversation it ends (the earlier turns' messages, this
request's input, and its output as an assistant message, in chat-completions message shape; ``instructions``
are not carried over, as OpenAI does), the session key of the conversation (whose server-side KV caches a
follow-up resumes through the engine's affinity store), and its owner: whose conversations a request may
resume (``request_parts.cache_owner``: the API key's id, on an open gateway the bearer token's, else the
client's address). An entry is visible to its owner only; anyone else gets exactly what a missing id gets,
so ids cannot be probed.

``ResponsesStore`` is this process's memory (one replica); ``gateway/responses/redis_store.py`` shares entries
between replicas through Redis. Both keep entries as encoded bytes and are bounded: each entry for ``ttl_s``
seconds and at most ``max_entry_bytes``; in memory at most ``max_entries`` and ``max_bytes`` in all (the
oldest go first); in Redis at most ``max_per_owner`` per owner. Every method is a coroutine: a store may do
I/O, and large entries are encoded and decoded off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_MAX_ENTRY_BYTES",
    "DEFAULT_MAX_PER_OWNER",
    "DEFAULT_TTL_S",
    "ResponseStore",
    "ResponsesStore",
    "StoredResponse",
    "decode_entry",
    "encode_entry",
]

DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_TTL_S = 3600.0
#: all entries of one in-memory store together
DEFAULT_MAX_BYTES = 256 * 2**20
#: one entry: a conversation longer than this is refused before it runs (``store: false`` still works)
DEFAULT_MAX_ENTRY_BYTES = 4 * 2**20
#: entries of one owner in Redis (the oldest go first)
DEFAULT_MAX_PER_OWNER = 1000
#: entries at least this big are encoded and decoded on a worker thread, not on the event loop
_OFF_LOOP_BYTES = 64 * 1024


@dataclass
class StoredResponse:
    id: str
    #: whose it is (``request_parts.cache_owner``); None only in tests of the store itself
    owner: str | None
    #: names the conversation's cached server session (the engine's affinity key)
    session_key: str
    #: the whole conversation up to and including this response's output, as chat messages
    messages: list[dict[str, Any]]
    #: the response object as it was sent (JSON-ready)
    response: dict[str, Any]
    expires_at: float = field(default=0.0)


def _encode(entry: StoredResponse) -> bytes:
    fields = {k: getattr(entry, k) for k in ("id", "owner", "session_key", "messages", "response")}
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode()


def _decode(data: bytes) -> StoredResponse:
    return StoredResponse(**json.loads(data))


async def encode_entry(entry: StoredResponse) -> bytes:
    """``entry`` as JSON bytes; conversations of many turns are encoded on a worker thread."""
    rough = sum(len(str(m.get("content") or "")) for m in entry.messages)
    return await asyncio.to_thread(_encode, entry) if rough >= _OFF_LOOP_BYTES else _encode(entry)


async def decode_entry(data: bytes) -> StoredResponse:
    return await asyncio.to_thread(_decode, data) if len(data) >= _OFF_LOOP_BYTES else _decode(data)


class ResponseStore(Protocol):
    """What the Responses API needs of a store (in memory here, or ``RedisResponsesStore``)."""

    #: the largest encoded entry it keeps
    max_entry_bytes: int

    async def put(self, entry: StoredResponse) -> bool:
        """Keep ``entry`` (replacing one of the same id); False when it is over ``max_entry_bytes``."""
        ...

    async def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """The entry, if it exists, has not expired, and belongs to ``owner``; else None."""
        ...

    async def delete(self, response_id: str, owner: str | None) -> bool: ...

    async def aclose(self) -> None: ...


class ResponsesStore:
    """This process's memory: at most ``max_entries`` entries and ``max_bytes`` of them, each kept ``ttl_s``
    seconds; insertion order is age order, so the oldest go first."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
    ):
        if max_entries < 1 or ttl_s <= 0 or max_bytes < 1 or max_entry_bytes < 1:
            raise ValueError("a responses store needs max_entries, ttl_s, max_bytes and max_entry_bytes > 0")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.max_entry_bytes = min(max_entry_bytes, max_bytes)
        self._clock = clock
        #: id → (expires at, owner, encoded entry)
        self._entries: OrderedDict[str, tuple[float, str | None, bytes]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """Encoded bytes of the entries kept now."""
        self._expire()
        return self._bytes

    async def put(self, entry: StoredResponse) -> bool:
        data = await encode_entry(entry)
        if len(data) > self.max_entry_bytes:
            return False
        self._expire()
        self._drop(entry.id)
        self._entries[entry.id] = (self._clock() + self.ttl_s, entry.owner, data)
        self._bytes += len(data)
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    async def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        self._expire()
        kept = self._entries.get(response_id)
        if kept is None or kept[1] != owner:
            return None
        entry = await decode_entry(kept[2])
        entry.expires_at = kept[0]
        return entry

    async def delete(self, response_id: str, owner: str | None) -> bool:
        self._expire()
        kept = self._entries.get(response_id)
        if kept is None or kept[1] != owner:
            return False
        self._drop(response_id)
        return True

    async def aclose(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _drop(self, response_id: str) -> None:
        kept = self._entries.pop(response_id, None)
        if kept is not None:
            self._bytes -= len(kept[2])

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            oldest = next(iter(self._entries))
            if self._entries[oldest][0] > now:
                return
            self._drop(oldest)
