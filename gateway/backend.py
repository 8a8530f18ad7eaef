"""The seam between the gateway's sampling loop and whatever computes logits.

A ``ModelBackend`` opens ``DecodeSession``s. A session keeps the KV cache of the tokens it has
processed (on the swarm's servers for ``SwarmBackend``, in-process for ``LocalBackend``) so a step only
sends new tokens. Every call here is blocking; the engine runs them in a worker thread.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class DecodeSession(Protocol):
    #: number of tokens whose keys/values the session holds
    position: int
    #: the token ids processed so far (``len(token_ids) == position``)
    token_ids: list[int]

    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Feed ``token_ids`` after the current position; return float32 logits ``[vocab]`` of the last one."""

    def rollback(self, position: int) -> None:
        """Forget everything after ``position`` (``0 <= position <= self.position``)."""

    def close(self) -> None: ...


class ModelBackend(Protocol):
    model_id: str
    tokenizer: Any
    #: the context window (prompt + completion tokens)
    max_context: int

    def open_session(self, max_length: int, session_id: str | None = None) -> DecodeSession: ...

    def swarm_state(self) -> dict: ...

    def close(self) -> None: ...
