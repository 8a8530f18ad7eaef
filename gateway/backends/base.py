"""The seam between the gateway's sampling loop and whatever computes logits.

A ``ModelBackend`` opens ``DecodeSession``s. A session keeps the KV cache of the tokens it has
processed (on the swarm's servers for ``SwarmBackend``, in-process for ``LocalBackend``) so a step only
sends new tokens. Every call here is blocking; the engine runs them in a worker thread.

Two optional abilities, each declared here so the engine reaches them through a type, not a guess:

- Reuse across requests (``ResumableBackend``: a backend that sets ``supports_resume = True``; check with
  ``can_resume``): a finished session can be ``detach``-ed — closed with its caches kept — into a
  ``SessionSnapshot``, and a later request (of any gateway replica, for the swarm) passes that snapshot to
  ``open_session(..., resume=...)`` to continue from it. The engine keeps snapshots in the affinity store
  (gateway/affinity/sessions.py).
- Batched decode steps (``BatchingBackend``: a backend with ``step_many`` and ``step_group``; check with
  ``isinstance``): one call steps several sessions (gateway/decode/batch.py).
- Every position's logits (``supports_all_logits = True``; check with ``can_speculate``): ``step(...,
  all_logits=True)``, which speculative decoding needs to check several guessed tokens in one step.
- LoRA adapters (``AdapterBackend``: a backend with ``served_adapters``; check with ``isinstance``): the
  adapters it can run now; ``open_session(..., adapter=NAME)`` opens a session running one
  (gateway/backends/adapters.py).
- Saying where a session runs (``RouteReportingBackend``: a backend with ``describe_route``; check with
  ``isinstance``): which servers hold its blocks, for the ``x-swarm-route`` headers (gateway/api/route_info.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard, runtime_checkable

import torch

__all__ = [
    "DEFAULT_CONTEXT_WINDOW",
    "AdapterBackend",
    "BatchingBackend",
    "DecodeSession",
    "ModelBackend",
    "ResumableBackend",
    "ResumableSession",
    "RouteHopInfo",
    "RouteReportingBackend",
    "SessionRoute",
    "SessionSnapshot",
    "can_resume",
    "can_speculate",
    "context_window",
]


@dataclass
class SessionSnapshot:
    """What a detached session leaves behind: enough to re-attach its caches from any process."""

    #: backend-specific and JSON-able (the swarm's: ``InferenceSession.export_state()`` — hops, server ids)
    state: dict[str, Any]
    #: the tokens the caches hold, in order
    token_ids: list[int]


class DecodeSession(Protocol):
    # read-only properties: a plain attribute satisfies them as well as a property does
    @property
    def position(self) -> int:
        """Number of tokens whose keys/values the session holds."""

    @property
    def token_ids(self) -> list[int]:
        """The token ids processed so far (``len(token_ids) == position``)."""

    def step(self, token_ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Feed ``token_ids`` after the current position; return the last one's float32 logits ``[vocab]``
        (``all_logits``: every fed position's, ``[len(token_ids), vocab]``, for speculative decoding)."""

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
        """A new session for up to ``max_length`` tokens (a ``ResumableBackend`` also takes ``resume=``)."""

    def swarm_state(self) -> dict: ...

    def close(self) -> None: ...


class ResumableBackend(ModelBackend, Protocol):
    """A backend whose sessions outlive a request: ``detach`` one, ``open_session(resume=...)`` it later."""

    #: True: the ability is there (a backend may carry the attribute set to False)
    supports_resume: bool

    def open_session(
        self, max_length: int, session_id: str | None = None, resume: SessionSnapshot | None = None
    ) -> ResumableSession:
        """As ``ModelBackend.open_session``; with ``resume``, continue that detached session (``token_ids`` as
        in the snapshot) with its cap raised to ``max_length`` if that is larger (a later turn may need more
        room than the first asked for), raising ``swarm_client.errors.SessionNotFoundError`` when its caches
        are gone."""


def can_resume(backend: ModelBackend) -> TypeGuard[ResumableBackend]:
    """True for a backend that declares ``supports_resume = True``."""
    return bool(getattr(backend, "supports_resume", False))


def can_speculate(backend: ModelBackend) -> bool:
    """True for a backend that declares ``supports_all_logits = True``: its sessions' ``step`` takes
    ``all_logits`` (every fed position's logits), so the engine may verify guessed tokens
    (gateway/speculation/verify.py)."""
    return bool(getattr(backend, "supports_all_logits", False))


@runtime_checkable
class BatchingBackend(Protocol):
    """A backend that steps several of its sessions in one call (``isinstance`` checks that both are there)."""

    def step_many(
        self, sessions: Sequence[DecodeSession], token_ids: Sequence[list[int]], all_logits: bool = False
    ) -> list[torch.Tensor | BaseException]:
        """One step of each of ``sessions`` (opened by this backend), each fed its ``token_ids``: per session
        its logits (``all_logits``: of every fed position) or the exception its step raised, the same as
        stepping them one by one.

        A backend may also take ``on_ready`` (a callable of ``[(index, result), ...]``) and hand results
        over early with it, before late steps complete (``accepts_on_ready``; the swarm backend does)."""

    def step_group(self, session: DecodeSession) -> Hashable:
        """Which ``step_many`` call ``session`` may share: sessions of different groups are stepped apart."""


def accepts_on_ready(backend: BatchingBackend) -> bool:
    """Whether ``backend.step_many`` takes ``on_ready`` (hands results over before its late steps end)."""
    try:
        return "on_ready" in inspect.signature(backend.step_many).parameters
    except (TypeError, ValueError):
        return False


@runtime_checkable
class AdapterBackend(Protocol):
    """A backend serving LoRA adapters besides the base model (``isinstance`` checks it is there); its
    ``open_session`` takes ``adapter=NAME`` (a ``ResumableBackend``'s ``resume`` then continues a session only
    if it ran the same adapter)."""

    def served_adapters(self) -> list[str]:
        """The adapters a session can run now (blocking: it may read the swarm's view)."""


@dataclass(frozen=True)
class RouteHopInfo:
    """One server of a session's route: its peer id and the blocks ``[start, end)`` it runs."""

    peer_id: str
    start: int
    end: int


@dataclass(frozen=True)
class SessionRoute:
    """Where a session's blocks run: its servers in order (empty for an in-process model, ``local``), and
    whether they push each step's output server to server."""

    hops: tuple[RouteHopInfo, ...] = ()
    push: bool = False
    local: bool = False


@runtime_checkable
class RouteReportingBackend(Protocol):
    """A backend that says which servers run a session it opened (``isinstance`` checks it is there)."""

    def describe_route(self, session: DecodeSession) -> SessionRoute | None:
        """``session``'s route as of now (its planned one before the first step opens the streams); None
        when ``session`` is not one of this backend's."""


#: the window assumed for a model that names none anywhere (BLOOM's ALiBi has no positions table; it was
#: trained on 2048-token sequences)
DEFAULT_CONTEXT_WINDOW = 2048
_CONFIG_WINDOW_FIELDS = ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length")


def context_window(config: Any, tokenizer: Any) -> int:
    """The model's context window: its config's positions limit (under whichever name the family uses),
    else the tokenizer's ``model_max_length`` when that is a real value, else ``DEFAULT_CONTEXT_WINDOW``."""
    for name in _CONFIG_WINDOW_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < 10**8:  # transformers' "no limit" is a 1e30 sentinel
        return value
    return DEFAULT_CONTEXT_WINDOW
