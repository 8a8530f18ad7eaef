"""The gateway's access log: one INFO line per finished request on the ``gateway.access`` logger.

    3f9c0e…  127.0.0.1 "POST /v1/chat/completions" 200 prompt_tokens=12 completion_tokens=5 cached_tokens=0 84.2ms

Fields: the request id (the ``x-request-id`` the app echoes), the client address, method and path (no query
string), the final status, token counts (``-`` where the request generated nothing) and the time from the
request to the end of its response — for a stream, to its last frame. The same values ride on the record
as attributes (``request_id``, ``method``, ``path``, ``status``, ``prompt_tokens``, ``completion_tokens``,
``cached_tokens``, ``duration_ms``) for structured handlers.

``metrics.MetricsMiddleware`` writes the line (it already sees every request, status and duration); tokens
come from ``GatewayMetrics.observe_usage``, the engine's one call per finished choice, which adds them to
the ``RequestTally`` of the request it runs in (a context variable the middleware sets). With ``n`` choices
the prompt is counted once per choice, as each choice prefills its own session.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar, Token
from dataclasses import dataclass

from starlette.types import Scope

__all__ = ["RequestTally", "count_choice", "end_tally", "log_request", "start_tally"]

logger = logging.getLogger("gateway.access")

_tally: ContextVar[RequestTally | None] = ContextVar("gateway_request_tally", default=None)


@dataclass
class RequestTally:
    """Tokens of one request's finished choices."""

    choices: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


def start_tally() -> tuple[RequestTally, Token[RequestTally | None]]:
    """A fresh tally for the request running in this context; pass the token to ``ContextVar.reset`` via
    ``end_tally`` when the request is done."""
    tally = RequestTally()
    return tally, _tally.set(tally)


def end_tally(token: Token[RequestTally | None]) -> None:
    _tally.reset(token)


def count_choice(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
    """Add one finished choice to the current request's tally (nothing outside a request)."""
    tally = _tally.get()
    if tally is None:
        return
    tally.choices += 1
    tally.prompt_tokens += max(0, prompt_tokens)
    tally.completion_tokens += max(0, completion_tokens)
    tally.cached_tokens += max(0, cached_tokens)


def log_request(scope: Scope, status: int, tally: RequestTally, duration_s: float) -> None:
    """Write the access line of a finished request."""
    if not logger.isEnabledFor(logging.INFO):
        return
    request_id = scope.get("state", {}).get("request_id", "-")
    client = scope.get("client")
    method, path = scope.get("method", ""), scope.get("path", "")
    counted = tally.choices > 0
    prompt = tally.prompt_tokens if counted else None
    completion = tally.completion_tokens if counted else None
    cached = tally.cached_tokens if counted else None
    duration_ms = round(duration_s * 1000, 1)
    logger.info(
        '%s %s "%s %s" %d prompt_tokens=%s completion_tokens=%s cached_tokens=%s %.1fms',
        request_id,
        client[0] if client else "-",
        method,
        path,
        status,
        _or_dash(prompt),
        _or_dash(completion),
        _or_dash(cached),
        duration_ms,
        extra={
            "request_id": request_id,
            "method": method,
            "path": path,
            "status": status,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "cached_tokens": cached,
            "duration_ms": duration_ms,
        },
    )


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)
