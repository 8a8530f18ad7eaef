"""``LocalBackend``: the ``ModelBackend`` protocol over a 🤗 model running in this process.

The reference the swarm backend is compared with, and what the gateway's fast tests run on. Each
``DecodeSession`` holds its own ``DynamicCache``; sessions may step concurrently from different threads (a
forward pass under ``inference_mode`` does not mutate the model).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from gateway.backends.base import DecodeSession, SessionRoute, context_window

__all__ = ["LocalBackend", "LocalSession"]


class LocalSession:
    """One sequence's KV cache. Not thread-safe: one call at a time (the engine guarantees it)."""

    def __init__(self, backend: LocalBackend, max_length: int, session_id: str | None):
        self.backend = backend
        self.max_length = max_length
        self.session_id = session_id
        self.token_ids: list[int] = []
        self._cache: DynamicCache | None = DynamicCache(config=backend.model.config)
        self.closed = False

    @property
    def position(self) -> int:
        return len(self.token_ids)

    def step(self, token_ids: list[int], all_logits: bool = False) -> torch.Tensor:
        if self.closed or self._cache is None:
            raise RuntimeError("step() on a closed session")
        if not token_ids:
            raise ValueError("step() needs at least one token")
        if self.position + len(token_ids) > self.max_length:
            raise ValueError(
                f"session max_length {self.max_length} exceeded ({self.position} + {len(token_ids)})"
            )
        model = self.backend.model
        start = self.position
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)  # [1, T]
        positions = torch.arange(start, start + len(token_ids), device=model.device)
        with torch.inference_mode():
            out = model(
                input_ids=input_ids,
                position_ids=positions[None],
                cache_position=positions,
                cache=self._cache,
                use_cache=True,
                logits_to_keep=len(token_ids) if all_logits else 1,
            )
        self.token_ids.extend(token_ids)
        return out.logits[0].float().cpu() if all_logits else out.logits[0, -1].float().cpu()  # [T, vocab] / [vocab]

    def rollback(self, position: int) -> None:
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot roll back to {position} from {self.position}")
        if self._cache is not None and position < self.position:
            self._cache.crop(position - self.position)  # transformers 5: a negative count of tokens to drop
        del self.token_ids[position:]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._cache = None
        self.backend._forget(self)


class LocalBackend:
    """A whole model in this process, behind the same protocol as the swarm."""

    #: ``step(..., all_logits=True)`` gives every position's logits (speculative decoding)
    supports_all_logits = True

    def __init__(
        self,
        model_path: str | Path,
        *,
        model_id: str | None = None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        max_context: int | None = None,
        **from_pretrained: Any,
    ):
        self.model_id = model_id or str(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, **from_pretrained)
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **from_pretrained).to(device).eval()
        )
        self.generation_config = self.model.generation_config
        self.max_context = int(max_context or context_window(self.model.config, self.tokenizer))
        self._lock = threading.Lock()
        self._sessions: set[LocalSession] = set()
        #: sessions ever opened (tests check that every one was closed)
        self.sessions_opened = 0

    @property
    def num_blocks(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def open_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def open_session(self, max_length: int, session_id: str | None = None) -> LocalSession:
        if max_length > self.max_context:
            raise ValueError(f"max_length {max_length} exceeds the context window {self.max_context}")
        session = LocalSession(self, max_length, session_id)
        with self._lock:
            self._sessions.add(session)
            self.sessions_opened += 1
        return session

    def describe_route(self, session: DecodeSession) -> SessionRoute | None:
        """No swarm: every block runs in this process (``RouteReportingBackend``)."""
        return SessionRoute(local=True) if isinstance(session, LocalSession) else None

    def _forget(self, session: LocalSession) -> None:
        with self._lock:
            self._sessions.discard(session)

    def swarm_state(self) -> dict:
        return {
            "model": self.model_id,
            "backend": "local",
            "num_blocks": self.num_blocks,
            "missing_blocks": [],
            "spans": [{"peer_id": "local", "start": 0, "end": self.num_blocks, "state": "ONLINE"}],
            "open_sessions": self.open_sessions,
        }

    def close(self) -> None:
        with self._lock:
            sessions = list(self._sessions)
        for s in sessions:
            s.close()
