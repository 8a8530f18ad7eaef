"""Typed errors raised by swarm_client.

    SwarmError
    ├── NoRouteError            no chain of ONLINE servers covers the requested blocks
    ├── PeerError               a server misbehaved (timeout, broken stream, invalid output)
    │   └── PeerTimeout
    ├── RemoteError             a server answered with a structured error
    │   ├── InvalidInputError   bad shape / dtype / hidden size / metadata
    │   ├── AdapterNotFoundError the server holds no LoRA adapter of that name
    │   ├── LengthExceededError a step would go past the session's max_length
    │   ├── SessionNotFoundError unknown (or expired / evicted) session id
    │   │   └── SessionAccessError the session exists but the caller may not use it (no capability)
    │   ├── SessionTooLongError  the session's max_length is more than this server can ever hold
    │   └── CacheExhaustedError the server's KV-cache budget cannot fit the request
    │       ├── ServerBusyError  full for now (sessions or cache), with how much is free: not a fault
    │       └── SessionEvictedError a full server took this idle session's cache back: re-open it
    ├── SwarmBusyError          every server that could serve a span is full right now
    └── SessionLost             failover gave up (deadline passed, no replacement)

A full server is not a broken one: ``ServerBusyError`` and ``SessionTooLongError`` never get a server banned;
the client routes around them, and says ``SwarmBusyError`` (with a retry hint) when nobody has room.

Servers put ``{"error": {"code": ..., "message": ...}}`` in the response metadata; ``error_from_wire``
turns it back into the matching class on the client.
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base class of every error swarm_client raises on purpose."""


class NoRouteError(SwarmError):
    """``missing_blocks``: the blocks no usable server holds; ``adapter``: the LoRA adapter the route needed."""

    def __init__(self, message: str, missing_blocks: list[int] | None = None, adapter: str | None = None):
        super().__init__(message)
        self.missing_blocks = list(missing_blocks or [])
        self.adapter = adapter


class PeerError(SwarmError):
    """A server failed in a way that justifies banning it and trying another one."""

    def __init__(self, message: str, peer_id: str | None = None):
        super().__init__(message)
        self.peer_id = peer_id


class PeerTimeout(PeerError):
    pass


class PushMismatchError(PeerError):
    """A server ran a pushed step whose input differs from what the previous server returned to the client:
    the previous server pushed one thing and answered another. Raised with no peer id; the session bans the
    previous server and redoes the step from it."""


class SessionLost(SwarmError):
    pass


class SwarmBusyError(SwarmError):
    """No server that holds the needed blocks has room for another session (or for this one's growth) now.
    ``retry_after`` (seconds) is a hint for when to try again."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class RemoteError(SwarmError):
    code = "remote_error"

    def __init__(self, message: str, peer_id: str | None = None, details: dict | None = None):
        super().__init__(message)
        self.peer_id = peer_id
        #: machine-readable facts the server sent with the error (``ServerBusyError``: what is free)
        self.details = dict(details or {})


class InvalidInputError(RemoteError):
    code = "invalid_input"


class LengthExceededError(RemoteError):
    code = "length_exceeded"


class SessionNotFoundError(RemoteError):
    code = "session_not_found"


class SessionAccessError(SessionNotFoundError):
    """The session is another client's: resuming it (or pushing into it) needs the capability its creator
    gave the server (``swarm_client.capabilities``). Recovery treats it like a lost session."""

    code = "session_access_denied"


class SessionTooLongError(RemoteError):
    """``max_length`` exceeds the server's whole cache budget (``details["cache_tokens_total"]``): no wait
    makes it fit there, another server might."""

    code = "session_too_long"


class CacheExhaustedError(RemoteError):
    code = "cache_exhausted"


class AdapterNotFoundError(RemoteError):
    """The server does not hold the LoRA adapter the session or request names (``--adapters``)."""

    code = "adapter_not_found"


class ServerBusyError(CacheExhaustedError):
    """Full for now: ``details["reason"]`` is ``sessions`` (the server's session slots), ``peer_sessions``
    (this client's share of them) or ``cache`` (token slots), with ``cache_tokens_left`` / ``sessions_left``."""

    code = "server_busy"


class SessionEvictedError(CacheExhaustedError):
    """A full server took this session's cache back for a peer within its share of the cache (the session's
    holder was over its own, and the session idle). Like any full server, not a fault: the client routes the
    span anew (replaying its history) without banning the server."""

    code = "session_evicted"


_BY_CODE: dict[str, type[RemoteError]] = {
    cls.code: cls
    for cls in (
        RemoteError,
        InvalidInputError,
        AdapterNotFoundError,
        LengthExceededError,
        SessionNotFoundError,
        SessionAccessError,
        SessionTooLongError,
        CacheExhaustedError,
        ServerBusyError,
        SessionEvictedError,
    )
}


#: details a server may send: small ints and short strings only (a stranger's payload is bounded)
_DETAIL_KEYS = ("reason", "cache_tokens_left", "cache_tokens_total", "sessions_left")


def error_to_wire(exc: RemoteError) -> dict:
    payload: dict = {"code": exc.code, "message": str(exc)}
    if exc.details:
        payload["details"] = exc.details
    return payload


def error_from_wire(payload: dict, peer_id: str | None = None) -> RemoteError:
    cls = _BY_CODE.get(str(payload.get("code")), RemoteError)
    raw = payload.get("details")
    details = {}
    if isinstance(raw, dict):
        for key in _DETAIL_KEYS:
            value = raw.get(key)
            if (isinstance(value, int) and not isinstance(value, bool) and value >= 0) or (
                isinstance(value, str) and len(value) <= 32
            ):
                details[key] = value
    return cls(str(payload.get("message", "unknown remote error"))[:1000], peer_id=peer_id, details=details)
