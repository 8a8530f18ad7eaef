"""The FastAPI application: ``create_app(backend, settings)``.

The caller owns the backend (creates it before, closes it after); the app only keeps it in ``app.state``.
The app owns its session-affinity store (``app.state.affinity``: Redis with ``settings.redis_url``, else in
memory; None with ``settings.affinity`` off) and its stored responses (``app.state.responses_store``, the
same choice), and closes them at shutdown.
Middleware, outermost first: CORS → ``RequestContextMiddleware`` (x-request-id and x-swarm-replica on every
response, and the 500 envelope for anything unexpected) → ``metrics.MetricsMiddleware`` (Prometheus metrics
and the access log line of every request, ``gateway/access_log.py``) → the admission chain of
``limits.install_limits`` (auth, body size, rate limits, stream slots) → Starlette's exception handlers
(``errors.install_error_handlers``).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.admission.limits import install_limits
from gateway.affinity.sessions import AffinityStore, create_store
from gateway.api.route_info import EXPOSED_HEADERS
from gateway.backends.base import ModelBackend
from gateway.backends.swarm_view import SwarmView
from gateway.decode.engine import Engine
from gateway.decode.shared_reservations import RedisReservations
from gateway.errors import error_response, install_error_handlers
from gateway.metrics import install_metrics
from gateway.responses.redis_store import RedisResponsesStore
from gateway.responses.store import ResponsesStore, ResponseStore
from gateway.routes import chat, chat_page, completions, health, models, responses, swarm_page
from gateway.routes.docs import install_docs
from gateway.settings import GatewaySettings

logger = logging.getLogger(__name__)

__all__ = ["REPLICA_HEADER", "RequestContextMiddleware", "create_app", "public_replica_id"]

REQUEST_ID_HEADER = "x-request-id"
#: the replica that answered (``settings.replica_id``, the name it writes into affinity records): behind a
#: load balancer, which of the gateway's replicas served each request
REPLICA_HEADER = "x-swarm-replica"
#: the longest start-up waits for the grammar engine's warm-up (gateway/grammars/compile.py) before serving
GRAMMAR_WARM_UP_WAIT_S = 15.0
_SAFE_REQUEST_ID = re.compile(r"^[\w.\-:/+=@]{1,128}$")
#: a replica id is the operator's or the host's name: anything else is replaced, so it is always a header value
_UNSAFE_REPLICA = re.compile(r"[^A-Za-z0-9._\-:]")


def public_replica_id(configured: str | None, engine: Engine) -> str:
    """The name ``x-swarm-replica`` shows: the operator's ``--replica-id``, else a digest of the default one
    (host, pid, a random suffix) — stable for the process, it tells replicas apart without telling the
    internet the host's name and the gateway's process id."""
    if configured:
        return configured
    return "replica-" + hashlib.sha256(engine.replica_id.encode()).hexdigest()[:12]


class RequestContextMiddleware:
    """Gives every request an id (the client's ``x-request-id`` if it is sane, else a new one), echoes it on
    the response with the replica's name (``x-swarm-replica``, when given), and turns an exception no handler
    caught into a 500 in the OpenAI envelope — Starlette's own fallback sits outside all middleware and would
    answer with a bare text 500."""

    def __init__(self, app: ASGIApp, replica_id: str | None = None):
        self.app = app
        self.replica = _UNSAFE_REPLICA.sub("_", replica_id)[:128] if replica_id else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = given if _SAFE_REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = MutableHeaders(scope=message)
                headers[REQUEST_ID_HEADER] = request_id
                if self.replica:
                    headers[REPLICA_HEADER] = self.replica
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("request %s %s (%s) failed", scope.get("method"), scope.get("path"), request_id)
            if started:
                raise  # headers are out; the server closes the connection
            await error_response(RuntimeError())(scope, receive, send_with_id)


def create_app(backend: ModelBackend, settings: GatewaySettings | None = None) -> FastAPI:
    """The gateway for ``backend``. Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
    ``/v1/models/{id}``, ``/health``, ``/v1/swarm``, ``/metrics``, and the pages ``/swarm``, ``/chat``,
    ``/docs``, ``/redoc``."""
    settings = settings or GatewaySettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # the grammar engine's tokenizer is built in a thread since the engine was made; it holds the GIL
        # ~1 s in one piece, so it finishes before the first request rather than stall its stream
        await app.state.engine.structured.wait_ready(GRAMMAR_WARM_UP_WAIT_S)
        yield
        app.state.engine.close()
        app.state.swarm_view.close()
        if app.state.affinity is not None:
            await app.state.affinity.aclose()
        await app.state.responses_store.aclose()
        await app.state.engine.capacity.aclose()

    app = FastAPI(
        title="swarmserve",
        summary="OpenAI-compatible gateway to a swarm of block servers",
        lifespan=lifespan,
        docs_url=None,  # FastAPI's pages load their JS and CSS from a CDN: install_docs serves them itself
        redoc_url=None,
    )
    app.state.backend = backend
    app.state.settings = settings
    app.state.affinity = _affinity_store(backend, settings)
    app.state.engine = Engine(backend, settings, app.state.affinity)
    if settings.redis_url:  # the capacity line's reservations, shared with the other replicas
        app.state.engine.capacity.board = RedisReservations(
            settings.redis_url, _namespace(backend), app.state.engine.replica_id
        )
    app.state.responses_store = _responses_store(backend, settings)  # /v1/responses' stored responses
    app.state.swarm_view = SwarmView(backend)  # /health, /v1/swarm: read off the loop, once per flood
    app.state.started_at = int(time.time())
    for router in (chat.router, completions.router, models.router, health.router, responses.router):
        app.include_router(router)
    app.include_router(swarm_page.router)  # /swarm: the HTML status page over /v1/swarm
    app.include_router(chat_page.router)  # /chat: a chat page over /v1/chat/completions
    install_docs(app)  # /docs, /redoc and their assets under /static/docs, no CDN
    install_error_handlers(app, retry_after_s=settings.retry_after_s)
    install_limits(app, settings)  # auth, body size, rate limits, stream slots (gateway/admission/limits.py)
    install_metrics(app)  # /metrics; its middleware wraps the limits, so their 401/413/429/503 count
    app.add_middleware(RequestContextMiddleware, replica_id=public_replica_id(settings.replica_id, app.state.engine))
    app.add_middleware(
        CORSMiddleware,
        allow_origins=settings.cors_origins,
        allow_methods=["*"],
        allow_headers=["*"],
        # x-swarm-route etc., for pages on other origins
        expose_headers=[REQUEST_ID_HEADER, REPLICA_HEADER, *EXPOSED_HEADERS],
    )
    return app


def _namespace(backend: ModelBackend) -> str:
    """One namespace per swarm and model, so replicas serving the same swarm share records."""
    return str(getattr(backend, "dht_prefix", None) or backend.model_id)


def _affinity_store(backend: ModelBackend, settings: GatewaySettings) -> AffinityStore | None:
    if not settings.affinity:
        return None
    namespace = _namespace(backend)
    return create_store(
        redis_url=settings.redis_url,
        namespace=namespace,
        ttl_s=settings.affinity_ttl_s,
        block_tokens=settings.affinity_block_tokens,
    )


def _responses_store(backend: ModelBackend, settings: GatewaySettings) -> ResponseStore:
    """Stored responses in Redis with ``settings.redis_url`` (shared by replicas), else in this process."""
    if settings.redis_url:
        return RedisResponsesStore(
            settings.redis_url,
            _namespace(backend),
            ttl_s=settings.responses_ttl_s,
            max_entry_bytes=settings.responses_max_entry_bytes,
            max_per_owner=settings.responses_max_per_owner,
        )
    return ResponsesStore(
        settings.responses_max_entries,
        settings.responses_ttl_s,
        max_bytes=settings.responses_max_bytes,
        max_entry_bytes=settings.responses_max_entry_bytes,
    )
