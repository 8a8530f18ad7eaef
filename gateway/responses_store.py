"""Stored responses of ``POST /v1/responses`` (``store: true``, the default): what ``previous_response_id``
continues and ``GET``/``DELETE /v1/responses/{id}`` read.

Each entry keeps the response as it was sent, the conversation it ends (the earlier turns' messages, this
request's input, and its output as an assistant message; ``instructions`` are not carried over, as OpenAI
does), the session key of the conversation (whose server-side KV caches a follow-up resumes through the
engine's affinity store), and its owner: the id of the API key that created it (``gateway/auth.py``), or,
on an open gateway, of the bearer token the client sent. An entry is visible to its owner only; anyone
else gets exactly what a missing id gets, so ids cannot be probed.

Bounded: at most ``max_entries`` (the oldest go first) and each for ``ttl_s`` seconds. In this process's
memory: several gateway replicas do not share it, so a follow-up must reach the replica that answered the
first turn (sticky routing), or it is a 404.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request

from gateway.auth import bearer_token, key_id

__all__ = ["ResponsesStore", "StoredResponse", "owner_of"]

DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_TTL_S = 3600.0


@dataclass
class StoredResponse:
    id: str
    #: the API key id that created it (None: an open gateway and no bearer token)
    owner: str | None
    #: names the conversation's cached server session (the engine's affinity key)
    session_key: str
    #: the whole conversation up to and including this response's output, as chat messages
    messages: list[dict[str, Any]]
    #: the response object as it was sent (JSON-ready)
    response: dict[str, Any]
    expires_at: float = field(default=0.0)


def owner_of(request: Request) -> str | None:
    """The API key id the auth middleware left; on an open gateway, the sent bearer token's id, if any."""
    given = request.scope.get("state", {}).get("api_key_id")
    if given:
        return str(given)
    token = bearer_token(Headers(scope=request.scope))
    return key_id(token) if token else None


class ResponsesStore:
    """At most ``max_entries`` responses, each kept ``ttl_s`` seconds; insertion order is age order."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError("a responses store needs max_entries >= 1 and ttl_s > 0")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @classmethod
    def from_env(cls) -> ResponsesStore:
        """Sized by ``SWARMSERVE_RESPONSES_MAX_ENTRIES`` and ``SWARMSERVE_RESPONSES_TTL_S`` when set."""
        max_entries = int(os.environ.get("SWARMSERVE_RESPONSES_MAX_ENTRIES", DEFAULT_MAX_ENTRIES))
        ttl_s = float(os.environ.get("SWARMSERVE_RESPONSES_TTL_S", DEFAULT_TTL_S))
        return cls(max_entries, ttl_s)

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        self._expire()
        entry.expires_at = self._clock() + self.ttl_s
        self._entries.pop(entry.id, None)
        self._entries[entry.id] = entry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """The entry, if it exists, has not expired, and belongs to ``owner``; else None."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        return entry

    def delete(self, response_id: str, owner: str | None) -> bool:
        if self.get(response_id, owner) is None:
            return False
        del self._entries[response_id]
        return True

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires_at > now:
                return
            self._entries.popitem(last=False)
