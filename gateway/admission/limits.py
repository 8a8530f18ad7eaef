"""The admission chain: what a request must pass before a route sees it.

Outermost first (``install_limits`` adds them; all sit inside ``RequestContextMiddleware``, so their answers
carry ``x-request-id`` and any bug in them is still a 500 in the envelope):

    AuthMiddleware            401 invalid_api_key            (gateway/admission/auth.py)
    BodySizeLimitMiddleware   413 request_too_large          checked on Content-Length before reading,
                                                             and on the bytes as they arrive
    RateLimitMiddleware       429 rate_limit_exceeded        (counting in gateway/admission/ratelimit.py)
    StreamLimitMiddleware     503 streams_saturated          a slot per choice of a generation request
                                                             (streamed or not; gateway/admission/stream_slots.py); a
                                                             bounded queue waits for them (at most
                                                             stream_queue_timeout_s)

The rate limiter needs the JSON body (its token estimate, counted on the tokenize thread,
gateway/decode/tokenize_thread.py) before the route parses it: ``read_body`` reads it once (after the size check),
keeps it in ``scope["state"]`` and replays it downstream, so the route's own parsing (and its 400s) are
unchanged.

The per-request timeout is the engine's ``request_timeout_s`` (a 504, or an error frame in a stream).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.admission.auth import APIKeys, AuthMiddleware, load_api_keys
from gateway.admission.ratelimit import (
    GENERATION_PATHS,
    ModelTokenCounter,
    RateLimiter,
    TiktokenCounter,
    TokenCounter,
    estimate_tokens,
    request_identity,
)
from gateway.admission.stream_slots import StreamLimitMiddleware, StreamSlots, StreamsSaturatedError, auto_stream_slots
from gateway.decode.tokenize_thread import TokenizeThread
from gateway.errors import GatewayError, InvalidRequestError, error_response
from gateway.schema.base import load_json_body
from gateway.settings import GatewaySettings

logger = logging.getLogger(__name__)

__all__ = [
    "BodySizeLimitMiddleware",
    "PayloadTooLargeError",
    "RateLimitMiddleware",
    "StreamLimitMiddleware",
    "StreamSlots",
    "StreamsSaturatedError",
    "install_limits",
    "read_body",
]

_BODY_STATE_KEY = "swarmserve.body"


class PayloadTooLargeError(GatewayError):
    status_code = 413
    type = "invalid_request_error"
    code = "request_too_large"

    def __init__(self, limit: int, size: int | None = None):
        got = f" ({size} bytes)" if size is not None else ""
        super().__init__(f"Request body too large{got}: this server accepts at most {limit} bytes.")


# ----------------------------------------------------------------------------------------------- the body


async def read_body(scope: Scope, receive: Receive) -> tuple[bytes, Receive]:
    """The whole request body, and a ``receive`` for the app downstream that replays it first.

    The body is kept in the scope: a second caller further down gets it from there, together with the
    ``receive`` it was handed (already a replaying one), so the app still sees the body exactly once."""
    state = scope.setdefault("state", {})
    cached = state.get(_BODY_STATE_KEY)
    if cached is not None:
        return cached, receive
    chunks: list[bytes] = []
    disconnected = False
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            disconnected = True
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    state[_BODY_STATE_KEY] = body
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed and not disconnected:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        if disconnected:
            return {"type": "http.disconnect"}
        return await receive()

    return body, replay


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        data = load_json_body(body)
    except InvalidRequestError:  # the route answers it with a 400
        return None
    return data if isinstance(data, dict) else None


def _estimate(path: str, body: bytes, counter: TokenCounter | None, **limits: int) -> int:
    return estimate_tokens(path, _json_object(body), counter, **limits)


def _is_generation(scope: Scope) -> bool:
    return scope["type"] == "http" and scope.get("method") == "POST" and scope.get("path") in GENERATION_PATHS


class BodySizeLimitMiddleware:
    """413 for a body over ``max_bytes``: at once when ``Content-Length`` says so (nothing is read), else
    as soon as the received bytes pass the limit (a chunked upload, or a lying header)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.max_bytes <= 0:
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await error_response(PayloadTooLargeError(limit, int(declared)))(scope, receive, send)
            return
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise PayloadTooLargeError(limit)
            return message

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, send_tracked)
        except PayloadTooLargeError as exc:  # raised while a middleware below read the body
            if started:
                raise
            await error_response(exc)(scope, receive, send)


# ------------------------------------------------------------------------------------------ rate limiting


class RateLimitMiddleware:
    """Applies ``limiter`` to POSTs on the generation routes; other routes pass untouched. Admitted
    responses carry OpenAI's ``x-ratelimit-*`` headers."""

    def __init__(
        self,
        app: ASGIApp,
        limiter: RateLimiter,
        counter: TokenCounter | None,
        *,
        default_max_tokens: int,
        max_context: int,
        max_choices: int,
        trusted_proxies: Collection[str] = (),
        tokenize: TokenizeThread | None = None,
    ):
        self.app = app
        self.limiter = limiter
        self.counter = counter  # the tokenize thread's tokenizer: used there only
        self.tokenize = tokenize
        self.trusted_proxies = frozenset(trusted_proxies)
        self.default_max_tokens = default_max_tokens
        self.max_context = max_context
        self.max_choices = max_choices

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.limiter.enabled or not _is_generation(scope):
            await self.app(scope, receive, send)
            return
        tokens = 0
        if self.limiter.tpm > 0:
            body, receive = await read_body(scope, receive)
            estimate = functools.partial(
                _estimate,
                scope["path"],
                body,
                self.counter,
                default_max_tokens=self.default_max_tokens,
                max_context=self.max_context,
                max_choices=self.max_choices,
            )
            # counting a body of megabytes takes seconds: on the tokenize thread, whose tokenizer it uses
            tokens = await self.tokenize.run(estimate) if self.tokenize is not None else estimate()
        decision = await self.limiter.check(request_identity(scope, self.trusted_proxies), tokens)
        if not decision.admitted:
            err = self.limiter.refusal(decision, tokens)
            logger.info("%s %s → 429 (%s)", scope.get("method"), scope.get("path"), err.message)
            await error_response(err)(scope, receive, send)
            return
        headers = decision.headers()

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                mutable = MutableHeaders(scope=message)
                for name, value in headers.items():
                    mutable[name] = value
            await send(message)

        await self.app(scope, receive, send_with_headers)


# ---------------------------------------------------------------------------------------------- install


def token_counter(settings: GatewaySettings, tokenizer: Any, max_context: int | None = None) -> TokenCounter | None:
    """The rate limiter's token counter: a tiktoken BPE file if configured, else the model's tokenizer (the
    tokenize thread's copy: the count runs there)."""
    if settings.rate_limit_tiktoken_file:
        return TiktokenCounter.from_bpe_file(settings.rate_limit_tiktoken_file)
    return ModelTokenCounter(tokenizer, max_context) if tokenizer is not None else None


def install_limits(app: FastAPI, settings: GatewaySettings) -> None:
    """Add the admission chain (module docstring) to ``app``; call before adding
    ``RequestContextMiddleware`` so the chain sits inside it. Fails fast on a missing key file."""
    keys = APIKeys(load_api_keys(settings.api_keys, settings.api_keys_file))
    if not keys and settings.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s without API keys: anyone who can reach it can use it", settings.host)
    engine = getattr(app.state, "engine", None)
    backend = getattr(app.state, "backend", None)
    tokenize: TokenizeThread | None = getattr(engine, "tokenize", None)
    max_context = int(getattr(backend, "max_context", 0) or 2**31)
    limiter = RateLimiter(settings.rate_limit_rpm, settings.rate_limit_tpm, redis_url=settings.redis_url)
    max_active = settings.max_concurrent_streams
    if max_active is None:  # the default: from this machine's cores (gateway/admission/stream_slots.py)
        max_active = auto_stream_slots(settings.backend_threads, settings.max_choices)
    slots = StreamSlots(
        max_active,
        settings.max_queued_streams,
        settings.stream_queue_timeout_s,
        retry_after_s=settings.retry_after_s,
    )
    app.state.api_keys = keys
    app.state.rate_limiter = limiter
    app.state.stream_slots = slots

    # added innermost first: Starlette wraps each new middleware around the ones before it
    app.add_middleware(StreamLimitMiddleware, slots=slots)
    app.add_middleware(
        RateLimitMiddleware,
        limiter=limiter,
        counter=token_counter(settings, getattr(tokenize, "tokenizer", None), max_context) if limiter.tpm else None,
        default_max_tokens=settings.default_max_tokens,
        max_context=max_context,
        max_choices=settings.max_choices,
        trusted_proxies=settings.trusted_proxies,
        tokenize=tokenize,
    )
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(AuthMiddleware, keys=keys, exempt_paths=settings.auth_exempt_paths)

    # the limiter's Redis connection is closed with the app (the lifespan in app.py knows nothing of it)
    inner_lifespan = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: Any) -> AsyncIterator[Any]:
        async with inner_lifespan(app_) as state:
            try:
                yield state
            finally:
                await limiter.aclose()

    app.router.lifespan_context = lifespan
