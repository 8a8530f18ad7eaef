"""Typed errors raised by swarm_client.

    SwarmError
    ├── NoRouteError            no chain of ONLINE servers covers the requested blocks
    ├── PeerError               a server misbehaved (timeout, broken stream, invalid output)
    │   └── PeerTimeout
    ├── RemoteError             a server answered with a structured error
    │   ├── InvalidInputError   bad shape / dtype / hidden size / metadata
    │   ├── LengthExceededError a step would go past the session's max_length
    │   ├── SessionNotFoundError unknown (or expired / evicted) session id
    │   └── CacheExhaustedError the server's KV-cache budget cannot fit the request
    └── SessionLost             failover gave up (deadline passed, no replacement)

Servers put ``{"error": {"code": ..., "message": ...}}`` in the response metadata; ``error_from_wire``
turns it back into the matching class on the client.
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base class of every error swarm_client raises on purpose."""


class NoRouteError(SwarmError):
    def __init__(self, message: str, missing_blocks: list[int] | None = None):
        super().__init__(message)
        self.missing_blocks = list(missing_blocks or [])


class PeerError(SwarmError):
    """A server failed in a way that justifies banning it and trying another one."""

    def __init__(self, message: str, peer_id: str | None = None):
        super().__init__(message)
        self.peer_id = peer_id


class PeerTimeout(PeerError):
    pass


class SessionLost(SwarmError):
    pass


class RemoteError(SwarmError):
    code = "remote_error"

    def __init__(self, message: str, peer_id: str | None = None):
        super().__init__(message)
        self.peer_id = peer_id


class InvalidInputError(RemoteError):
    code = "invalid_input"


class LengthExceededError(RemoteError):
    code = "length_exceeded"


class SessionNotFoundError(RemoteError):
    code = "session_not_found"


class CacheExhaustedError(RemoteError):
    code = "cache_exhausted"


_BY_CODE: dict[str, type[RemoteError]] = {
    cls.code: cls
    for cls in (
        RemoteError,
        InvalidInputError,
        LengthExceededError,
        SessionNotFoundError,
        CacheExhaustedError,
    )
}


def error_to_wire(exc: RemoteError) -> dict:
    return {"code": exc.code, "message": str(exc)}


def error_from_wire(payload: dict, peer_id: str | None = None) -> RemoteError:
    cls = _BY_CODE.get(str(payload.get("code")), RemoteError)
    return cls(str(payload.get("message", "unknown remote error")), peer_id=peer_id)
