"""Capabilities for a session's server-side state: who may resume it and who may push steps into it.

A session id travels in plain sight (push chains, gateway records), so knowing it must not be enough.
When it opens a session, the client hands each server two tokens derived from a secret only it holds:

- ``resume_token(session_id)``: re-attaching the detached session later (a conversation's next turn)
  needs it; servers keep only its digest.
- ``push_token(session_id)``: the key that authorizes pushes into the session (``rpc_push``). The server
  keeps it; the client never gives it to another server. For each step it wants pushed, the client puts in
  the step's ``push_chain`` a ``push_auth(session_id, step_id, position, seq)``: an HMAC under that key of
  exactly that step, so the previous server of the chain can push that step and nothing else — not another
  position, not a replay of an old step (``seq`` must exceed every step the session has run).

The tokens are HMACs of the session id, so nothing needs storing: any process holding the same secret
(``SWARMSERVE_SESSION_SECRET``, e.g. every replica of one gateway) derives the same tokens and can resume
the others' sessions; without it each process draws a random secret and only it can resume its sessions.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

SECRET_ENV = "SWARMSERVE_SESSION_SECRET"
#: longest token a server accepts (hex of a SHA-256 HMAC is 64)
MAX_TOKEN_CHARS = 128

_process_secret: bytes | None = None


def session_secret() -> bytes:
    """The secret this process derives its tokens from (``$SWARMSERVE_SESSION_SECRET`` if set)."""
    global _process_secret
    configured = os.environ.get(SECRET_ENV)
    if configured:
        return configured.encode()
    if _process_secret is None:
        _process_secret = secrets.token_bytes(32)
    return _process_secret


def _token(purpose: bytes, session_id: str) -> str:
    return hmac.new(session_secret(), purpose + b"\0" + session_id.encode(), hashlib.sha256).hexdigest()


def resume_token(session_id: str) -> str:
    return _token(b"resume", session_id)


def push_token(session_id: str) -> str:
    return _token(b"push", session_id)


def step_mac(key: str, step_id: str, position: int, seq: int) -> str:
    """The authorization of one pushed step under a session's push ``key``."""
    message = f"{step_id}\0{position}\0{seq}".encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def push_auth(session_id: str, step_id: str, position: int, seq: int) -> str:
    """What the client gives the previous server of its chain to push this one step into ``session_id``."""
    return step_mac(push_token(session_id), step_id, position, seq)


def push_key(token: object) -> str | None:
    """The push key a server keeps from a session's open, or any token it was given if usable (None: none)."""
    return token if isinstance(token, str) and 1 <= len(token) <= MAX_TOKEN_CHARS else None


def push_auth_matches(key: str | None, metadata: dict) -> bool:
    """Whether a pushed step's ``push_auth`` authorizes its own ``step_id``, ``position`` and ``seq`` under the
    session's push ``key`` (constant time); malformed fields never match."""
    auth, step_id, position, seq = (metadata.get(k) for k in ("push_auth", "step_id", "position", "seq"))
    if key is None or not isinstance(auth, str) or len(auth) > MAX_TOKEN_CHARS or not isinstance(step_id, str):
        return False
    if not is_count(position) or not is_count(seq):
        return False
    return hmac.compare_digest(auth.encode(), step_mac(key, step_id, position, seq).encode())


def is_count(value: object) -> bool:
    """A non-negative int that fits the wire (msgpack's int64), not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**62


def token_digest(token: object) -> bytes | None:
    """What a server keeps of a token (None: no usable token was given)."""
    usable = push_key(token)
    return None if usable is None else hashlib.sha256(usable.encode()).digest()


def token_matches(token: object, digest: bytes | None) -> bool:
    """Whether ``token`` is the one whose digest the server kept (constant time)."""
    given = token_digest(token)
    return digest is not None and given is not None and hmac.compare_digest(given, digest)
