"""Capabilities for a session's server-side state: who may resume it and who may push steps into it.

A session id travels in plain sight (push chains, gateway records), so knowing it must not be enough.
When it opens a session, the client hands each server two tokens derived from a secret only it holds:

- ``resume_token(session_id)``: re-attaching the detached session later (a conversation's next turn)
  needs it; servers keep only its digest.
- ``push_token(session_id)``: the previous server of the client's chain needs it to push steps into the
  session (``rpc_push``); the client gives it to that server inside the step's ``push_chain``.

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


def token_digest(token: object) -> bytes | None:
    """What a server keeps of a token (None: no usable token was given)."""
    if not isinstance(token, str) or not 1 <= len(token) <= MAX_TOKEN_CHARS:
        return None
    return hashlib.sha256(token.encode()).digest()


def token_matches(token: object, digest: bytes | None) -> bool:
    """Whether ``token`` is the one whose digest the server kept (constant time)."""
    given = token_digest(token)
    return digest is not None and given is not None and hmac.compare_digest(given, digest)
