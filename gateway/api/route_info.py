"""Route and speed response headers of ``/v1/chat/completions`` and ``/v1/completions``.

Once a request's sessions are open (``Engine.start`` returned its ``Generation``), the backend can say which
servers run choice 0 (``RouteReportingBackend.describe_route``, gateway/backends/base.py). The headers:

- ``x-swarm-route``: choice 0's servers in order, ``<peer id>[<start>:<end>]`` each (full peer ids, as in
  ``/v1/swarm``; blocks ``start`` to ``end - 1``), joined by ``", "`` — e.g. ``12D3KooWA…[0:2], 12D3KooWB…[2:4]``;
  ``local`` for an in-process model. The route as the request starts: a failover later may change it.
- ``x-swarm-push``: ``true`` when the servers push each step's output straight to the next server.
- ``x-swarm-tokens-per-second`` (non-streamed responses only): completion tokens of all choices divided by
  the seconds from the sessions being open to the last token (the prompt's prefill included).

A backend that cannot describe its route (a test double) gets no route headers; the speed header is still
there. The headers are exposed to browsers through CORS (gateway/app.py).
"""

from __future__ import annotations

import logging
import re
import time

from gateway.backends.base import ModelBackend, RouteReportingBackend, SessionRoute
from gateway.decode.generation import Generation
from gateway.decode.session_handle import ReusableSession

logger = logging.getLogger(__name__)

__all__ = ["EXPOSED_HEADERS", "PUSH_HEADER", "ROUTE_HEADER", "SPEED_HEADER", "RouteInfo", "format_route"]

ROUTE_HEADER = "x-swarm-route"
PUSH_HEADER = "x-swarm-push"
SPEED_HEADER = "x-swarm-tokens-per-second"
#: what browsers may read (CORS ``expose_headers``)
EXPOSED_HEADERS = (ROUTE_HEADER, PUSH_HEADER, SPEED_HEADER)

#: peer ids are base58; anything else is replaced, so a header value can never break the response
_UNSAFE = re.compile(r"[^A-Za-z0-9._\-]")


def format_route(route: SessionRoute) -> str | None:
    """The ``x-swarm-route`` value: ``local``, or ``peer[start:end]`` per server joined by ``", "``."""
    if route.local:
        return "local"
    if not route.hops:
        return None
    return ", ".join(f"{_UNSAFE.sub('_', h.peer_id)}[{h.start}:{h.end}]" for h in route.hops)


class RouteInfo:
    """One request's route headers, read when its sessions are open; its clock for tokens/s starts then."""

    def __init__(self, route: SessionRoute | None):
        self.route = route
        self.started = time.perf_counter()

    @classmethod
    def of(cls, generation: Generation, backend: ModelBackend) -> RouteInfo:
        """Choice 0's route (its session as ``Engine.start`` opened it)."""
        return cls(_describe(generation, backend))

    def headers(self, completion_tokens: int | None = None) -> dict[str, str]:
        """The route headers, plus ``x-swarm-tokens-per-second`` when ``completion_tokens`` is given (call it
        when the last token is out)."""
        out: dict[str, str] = {}
        value = format_route(self.route) if self.route is not None else None
        if value is not None and self.route is not None:
            out[ROUTE_HEADER] = value
            out[PUSH_HEADER] = "true" if self.route.push else "false"
        if completion_tokens is not None:
            elapsed = max(time.perf_counter() - self.started, 1e-9)
            out[SPEED_HEADER] = f"{completion_tokens / elapsed:.2f}"
        return out


def _describe(generation: Generation, backend: ModelBackend) -> SessionRoute | None:
    if not isinstance(backend, RouteReportingBackend):
        return None
    # Generation keeps its handles private; choice 0's is the first (the one that resumes cached sessions)
    handles = generation.handles
    session = handles[0].session if handles else None
    if session is None:
        return None
    inner = session.inner if isinstance(session, ReusableSession) else session
    try:
        return backend.describe_route(inner)
    except Exception:  # headers are a courtesy: never fail a request over them
        logger.warning("describing a session's route failed", exc_info=True)
        return None
