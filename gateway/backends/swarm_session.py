"""One sequence decoded over the swarm (``SwarmSession``, what ``SwarmBackend.open_session`` returns), and
how failures below the client library become the swarm's errors (a 503 at the gateway, not a 500).

The session embeds its tokens and computes logits on the gateway's local head; every block runs on the
servers through its ``InferenceSession``. ``detach()`` keeps the servers' caches for a later request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gateway.backends.base import SessionSnapshot
from swarm_client.errors import PeerError, SwarmError
from swarm_client.routing import RouteHop
from swarm_client.session import InferenceSession

__all__ = ["SwarmSession", "as_swarm_errors", "swarm_error"]


def swarm_error(exc: BaseException) -> BaseException:
    """Whatever breaks below the client library (p2p daemon gone, sockets) is the swarm's fault: a 503."""
    if isinstance(exc, (TimeoutError, OSError, RuntimeError)) and not isinstance(exc, (SwarmError, ValueError)):
        error = PeerError(f"swarm transport failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error
    return exc


@contextlib.contextmanager
def as_swarm_errors() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        error = swarm_error(exc)
        if error is exc:
            raise
        raise error from exc


class SwarmSession:
    """One sequence decoded over the swarm. Not thread-safe: one call at a time (the engine guarantees it)."""

    def __init__(
        self,
        head: Any,
        inner: InferenceSession,
        max_length: int,
        session_id: str | None,
        on_close: Callable[[SwarmSession], None],
    ):
        #: the model's local head (embeddings, final norm, LM head: ``DistributedModelForCausalLM.head``)
        self.head = head
        self.inner = inner
        self._on_close = on_close
        self.max_length = max_length
        self.session_id = session_id
        self.token_ids: list[int] = []
        self.closed = False
        #: the route ``open_session`` checked; the first step routes again (the same servers unless the swarm
        #: changed meanwhile) and opens the streams there
        self.planned_route: list[RouteHop] = []

    @property
    def position(self) -> int:
        return len(self.token_ids)

    @property
    def route(self) -> list[RouteHop]:
        """The servers holding this session's streams, in order (failover may have changed them); before
        the first step, the route ``open_session`` planned."""
        return self.inner.route or list(self.planned_route)

    def step(self, token_ids: list[int], all_logits: bool = False) -> torch.Tensor:
        hidden = self._embed(token_ids)
        with torch.inference_mode(), as_swarm_errors():
            out = self.inner.step(hidden, position=self.position)  # [1, T, H]
        return self._finish(token_ids, hidden, out, all_logits)

    def _embed(self, token_ids: list[int]) -> torch.Tensor:
        """Check a step and embed its tokens: ``[1, T, H]``."""
        if self.closed:
            raise RuntimeError("step() on a closed session")
        if not token_ids:
            raise ValueError("step() needs at least one token")
        if self.position + len(token_ids) > self.max_length:
            raise ValueError(f"session max_length {self.max_length} exceeded ({self.position} + {len(token_ids)})")
        input_ids = torch.tensor([token_ids], dtype=torch.long)  # [1, T]
        with torch.inference_mode():
            return self.head.embed(input_ids).float()

    def _finish(
        self, token_ids: list[int], hidden: torch.Tensor, out: torch.Tensor, all_logits: bool = False
    ) -> torch.Tensor:
        """The last position's logits ``[vocab]`` from the blocks' output (``all_logits``: every position's,
        ``[T, vocab]``, as speculative decoding needs); the tokens now count as held."""
        with torch.inference_mode():
            logits = self.head.final((out if all_logits else out[:, -1:]).to(hidden.dtype))
        self.token_ids.extend(token_ids)
        return logits[0].float() if all_logits else logits[0, -1].float()

    def rollback(self, position: int) -> None:
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot roll back to {position} from {self.position}")
        if position < self.position:
            self.inner.rollback(position)  # the servers overwrite their caches from here on the next step
        del self.token_ids[position:]

    def close(self) -> None:
        """Close every server's stream; the servers free this session's KV cache."""
        if self.closed:
            return
        self.closed = True
        try:
            with as_swarm_errors():
                self.inner.close()
        finally:
            self._on_close(self)

    def detach(self) -> SessionSnapshot:
        """Close the streams but have the servers keep the caches; what ``open_session(resume=...)`` needs."""
        if self.closed:
            raise RuntimeError("detach() on a closed session")
        state = self.inner.export_state()
        state["token_ids"] = []  # ours are flat ids, kept in the snapshot; the inner ones are per batch row
        snapshot = SessionSnapshot(state, list(self.token_ids))
        self.inner.keep_on_close = True
        self.close()
        return snapshot
