"""The FastAPI application: ``create_app(backend, settings)``.

The caller owns the backend (creates it before, closes it after); the app only keeps it in ``app.state``.
Middleware, outermost first: CORS → ``RequestContextMiddleware`` (x-request-id on every response, and the
500 envelope for anything unexpected) → Starlette's exception handlers (``errors.install_error_handlers``).
"""

from __future__ import annotations

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

from gateway.backend import ModelBackend
from gateway.engine import Engine
from gateway.errors import error_response, install_error_handlers
from gateway.routes import ROUTERS
from gateway.settings import GatewaySettings

logger = logging.getLogger(__name__)

__all__ = ["RequestContextMiddleware", "create_app"]

REQUEST_ID_HEADER = "x-request-id"
_SAFE_REQUEST_ID = re.compile(r"^[\w.\-:/+=@]{1,128}$")


class RequestContextMiddleware:
    """Gives every request an id (the client's ``x-request-id`` if it is sane, else a new one), echoes it on
    the response, and turns an exception no handler caught into a 500 in the OpenAI envelope — Starlette's
    own fallback sits outside all middleware and would answer with a bare text 500."""

    def __init__(self, app: ASGIApp):
        self.app = app

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
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
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
    ``/v1/models/{id}``, ``/health``, ``/v1/swarm``."""
    settings = settings or GatewaySettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        app.state.engine.close()

    app = FastAPI(
        title="swarmserve", summary="OpenAI-compatible gateway to a swarm of block servers", lifespan=lifespan
    )
    app.state.backend = backend
    app.state.settings = settings
    app.state.engine = Engine(backend, settings)
    app.state.started_at = int(time.time())
    for router in ROUTERS:
        app.include_router(router)
    install_error_handlers(app, retry_after_s=settings.retry_after_s)
    app.add_middleware(RequestContextMiddleware)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=settings.cors_origins,
        allow_methods=["*"],
        allow_headers=["*"],
        expose_headers=[REQUEST_ID_HEADER],
    )
    return app
