"""Prometheus metrics of one gateway app, served at ``GET /metrics``.

Each app owns a ``CollectorRegistry`` (not prometheus_client's global one), so several gateways in one
process — tests, ``swarmserve up`` — neither clash on metric names nor mix their numbers.

Where the numbers come from:

- ``MetricsMiddleware`` (ASGI, outside the auth/limit middlewares so their 401/413/429/503 count too):
  requests by route template, method and status; request duration; errors by OpenAI error ``code`` — read
  from the JSON envelope of a >= 400 response, or from a ``data: {"error": ...}`` frame of a stream that
  failed after its 200; the number of SSE responses in flight (``active_streams``).
- ``Engine`` (``gateway/decode/engine.py``), once per choice: time to first token, inter-token latency, and
  ``observe_usage(prompt, completion, cached)`` — the one call that counts tokens and prefix-cache hits
  (for the counters, and for the access log line of the request it runs in).
- ``StreamSlots`` (``gateway/admission/limits.py``): streams waiting for a slot.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.datastructures import Headers
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.access_log import count_choice, end_tally, log_request, start_tally
from gateway.speculation.verify import SpeculationStats

logger = logging.getLogger(__name__)

__all__ = ["GatewayMetrics", "MetricsMiddleware", "install_metrics", "route_label"]

#: label of requests no route matches: one value, so scanners cannot blow up the label cardinality
UNMATCHED_ROUTE = "<unmatched>"
#: an error envelope is small; a larger >= 400 body is not ours and is not parsed
_MAX_ERROR_BODY = 64 * 1024
_STREAM_ERROR_PREFIX = b'data: {"error"'
#: any other method (the server accepts any token) is counted as OTHER: bounded label values again
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class GatewayMetrics:
    """The gateway's metrics in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "swarmserve_requests",
            "HTTP requests by route template, method and status code",
            ["route", "method", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "swarmserve_request_duration_seconds",
            "Time from request to the end of its response (streams too)",
            ["route"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "swarmserve_errors",
            "Errors answered in OpenAI's envelope, by its code (the type when code is null)",
            ["code"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "swarmserve_time_to_first_token_seconds",
            "Per choice: from opening its session to its first sampled token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "swarmserve_inter_token_latency_seconds",
            "Per choice: between two consecutive sampled tokens",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "swarmserve_prompt_tokens",
            "Prompt tokens of finished choices (each choice has its own session)",
            registry=r,
        )
        self.completion_tokens = Counter(
            "swarmserve_completion_tokens", "Tokens sampled (EOS included)", registry=r
        )
        self.cached_tokens = Counter(
            "swarmserve_cached_tokens",
            "Prompt tokens served from a reused KV cache (not recomputed)",
            registry=r,
        )
        self.cache_hits = Counter(
            "swarmserve_cache_reuse_hits",
            "Choices that reused a cached prefix (cached_tokens > 0)",
            registry=r,
        )
        self.speculated_tokens = Counter(
            "swarmserve_speculation_drafted_tokens",
            "Guessed tokens sent along with a decode step (speculative decoding)",
            registry=r,
        )
        self.speculation_accepted = Counter(
            "swarmserve_speculation_accepted_tokens",
            "Guessed tokens the model agreed with: output tokens that cost no trip of their own",
            registry=r,
        )
        self.speculation_steps = Counter(
            "swarmserve_speculation_steps", "Decode steps that carried guessed tokens", registry=r
        )
        #: drafted and accepted tokens so far, for the rate (the engine reports from its event loop only)
        self._speculation_totals = [0, 0]
        self.speculation_acceptance = Gauge(
            "swarmserve_speculation_acceptance_rate",
            "Accepted / drafted tokens since the gateway started (0 before any guess)",
            registry=r,
        )
        self.active_streams = Gauge(
            "swarmserve_active_streams", "SSE responses being sent right now", registry=r
        )
        self.queued_streams = Gauge(
            "swarmserve_queued_streams", "Streaming requests waiting for a stream slot", registry=r
        )

    def observe_usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> None:
        """Count one choice's tokens; ``cached_tokens`` (its ``prompt_tokens_details.cached_tokens``) > 0 is
        a prefix-cache hit. The engine calls this once per choice — pass the reused prefix length there.
        The choice also counts in its request's access log line."""
        count_choice(prompt_tokens, completion_tokens, cached_tokens)
        self.prompt_tokens.inc(max(0, prompt_tokens))
        self.completion_tokens.inc(max(0, completion_tokens))
        if cached_tokens > 0:
            self.cached_tokens.inc(cached_tokens)
            self.cache_hits.inc()

    def observe_speculation(self, stats: SpeculationStats) -> None:
        """Count one finished choice's guesses (gateway/speculation/verify.py) and update the acceptance rate."""
        if stats.drafted <= 0:
            return
        self.speculated_tokens.inc(stats.drafted)
        self.speculation_accepted.inc(stats.accepted)
        self.speculation_steps.inc(stats.steps)
        self._speculation_totals[0] += stats.drafted
        self._speculation_totals[1] += stats.accepted
        drafted, accepted = self._speculation_totals
        self.speculation_acceptance.set(accepted / drafted)

    def observe_error(self, code: str | None) -> None:
        self.errors.labels(code or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def route_label(scope: Scope) -> str:
    """The route template (``/v1/models/{model_id:path}``), never the raw path: bounded label values.

    The router leaves the matched route in the scope; a request answered before routing (a 401 from the
    auth middleware) is matched here against the app's routes."""
    path = getattr(scope.get("route"), "path", None)
    if isinstance(path, str):
        return path
    router = getattr(scope.get("app"), "router", None)
    return _match(getattr(router, "routes", ()), scope) or UNMATCHED_ROUTE


def _match(routes: Any, scope: Scope) -> str | None:
    """The template of the route among ``routes`` that matches ``scope`` (method aside). FastAPI >= 0.16x
    wraps included routers in an object without a path that holds the router (``original_router``)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            found = _match(getattr(inner, "routes", ()), scope)
            if found is not None:
                return found
            continue
        path = getattr(route, "path", None)
        if isinstance(path, str) and route.matches(scope)[0] is not Match.NONE:
            return path
    return None


def _error_code(payload: Any) -> str | None:
    """``code`` (else ``type``) of an OpenAI error envelope; None if ``payload`` is not one."""
    if not isinstance(payload, dict) or not isinstance(payload.get("error"), dict):
        return None
    error = payload["error"]
    code = error.get("code") or error.get("type")
    return str(code) if code else "unknown"


class MetricsMiddleware:
    """Counts every HTTP request by route and final status, its duration, its error code, and SSE
    responses in flight, and writes its access log line; the response passes through untouched (error
    bodies are copied, not held)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        m = self.metrics
        started_at = time.perf_counter()
        status = 500  # what the client gets when the app raises before answering
        streaming = False
        error_body: bytearray | None = None
        tally, tally_token = start_tally()

        async def send_counted(message: Message) -> None:
            nonlocal status, streaming, error_body
            if message["type"] == "http.response.start":
                status = int(message["status"])
                content_type = Headers(raw=message.get("headers", [])).get("content-type", "")
                if content_type.startswith("text/event-stream"):
                    streaming = True
                    m.active_streams.inc()
                elif status >= 400 and content_type.startswith("application/json"):
                    error_body = bytearray()
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                if error_body is not None and len(error_body) + len(body) <= _MAX_ERROR_BODY:
                    error_body += body
                elif streaming and body.startswith(_STREAM_ERROR_PREFIX):
                    m.observe_error(_stream_error_code(body))
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:
            m.observe_error("internal_error")  # the 500 envelope is written outside this middleware
            raise
        finally:
            end_tally(tally_token)
            duration_s = time.perf_counter() - started_at
            if streaming:
                m.active_streams.dec()
            route = route_label(scope)
            method = scope.get("method", "")
            m.requests.labels(route, method if method in _METHODS else "OTHER", str(status)).inc()
            m.request_duration.labels(route).observe(duration_s)
            log_request(scope, status, tally, duration_s)
            if error_body:
                try:
                    code = _error_code(json.loads(error_body))
                except ValueError:
                    code = None
                if code is not None:
                    m.observe_error(code)


def _stream_error_code(frame: bytes) -> str:
    try:
        return _error_code(json.loads(frame.removeprefix(b"data:").strip())) or "unknown"
    except ValueError:
        return "unknown"


router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def install_metrics(app: FastAPI) -> GatewayMetrics:
    """``/metrics``, the request middleware, and the engine's token hooks. Call it after
    ``install_limits`` (so the middleware sits outside theirs and sees their answers)."""
    m = GatewayMetrics()
    app.state.metrics = m
    app.include_router(router)
    engine = getattr(app.state, "engine", None)
    if engine is not None:
        engine.metrics = m
    slots = getattr(app.state, "stream_slots", None)
    if slots is not None:
        m.queued_streams.set_function(lambda: slots.queued)
    app.add_middleware(MetricsMiddleware, metrics=m)
    return m
