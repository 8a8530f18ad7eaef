"""The seam between the gateway's sampling loop and whatever computes logits.

A ``ModelBackend`` opens ``DecodeSession``s. A session keeps the KV cache of the tokens it has
processed (on the swarm's servers for ``SwarmBackend``, in-process for ``LocalBackend``) so a step only
sends new tokens. Every call here is blocking; the engine runs them in a worker thread.

Reuse across requests (optional: a backend that sets ``supports_resume = True``): a finished session can be
``detach``-ed — closed with its caches kept — into a ``SessionSnapshot``, and a later request (of any gateway
replica, for the swarm) passes that snapshot to ``open_session(..., resume=...)`` to continue from it. The
engine keeps snapshots in the affinity store (gateway/sessions.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["DecodeSession", "ModelBackend", "ResumableSession", "SessionSnapshot"]


@dataclass
class SessionSnapshot:
    """What a detached session leaves behind: enough to re-attach its caches from any process."""

    #: backend-specific and JSON-able (the swarm's: ``InferenceSession.export_state()`` — hops, server ids)
    state: dict[str, Any]
    #: the tokens the caches hold, in order
    token_ids: list[int]


class DecodeSession(Protocol):
    #: number of tokens whose keys/values the session holds
    position: int
    #: the token ids processed so far (``len(token_ids) == position``)
    token_ids: list[int]

    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Feed ``token_ids`` after the current position; return the last one's float32 logits ``[vocab]``."""

    def rollback(self, position: int) -> None:
        """Forget everything after ``position`` (``0 <= position <= self.position``)."""

    def close(self) -> None: ...


class ResumableSession(DecodeSession, Protocol):
    """A session of a backend with ``supports_resume = True``."""

    def detach(self) -> SessionSnapshot:
        """Close, but keep the caches (for the servers' session TTL) so ``open_session(resume=...)`` can
        continue from exactly ``token_ids``."""


class ModelBackend(Protocol):
    model_id: str
    tokenizer: Any
    #: the context window (prompt + completion tokens)
    max_context: int

    def open_session(self, max_length: int, session_id: str | None = None) -> DecodeSession:
        """A new session for up to ``max_length`` tokens. A backend with ``supports_resume = True`` also takes
        ``resume=SessionSnapshot`` and then continues that session (``token_ids`` as in the snapshot), raising
        ``swarm_client.errors.SessionNotFoundError`` when its caches are gone."""

    def swarm_state(self) -> dict: ...

    def close(self) -> None: ...
