"""The gateway's errors, and the one place where every error becomes OpenAI's error envelope.

    GatewayError                        status + {"error": {"message", "type", "param", "code"}}
    ├── InvalidRequestError             400 invalid_request_error
    │   ├── ContextLengthExceededError  400, code context_length_exceeded (names the limit and the total)
    │   └── UnsupportedParameterError   400, code unsupported_parameter (names the parameter)
    ├── ModelNotFoundError              404, code model_not_found
    ├── ServiceUnavailableError         503 + Retry-After (missing blocks, saturated swarm)
    └── GatewayTimeoutError             504, the request ran past ``request_timeout_s``

Lower layers are translated once, here, by ``to_gateway_error`` (also used for errors that happen after a
stream's 200, which become a ``data: {"error": ...}`` frame):

    fastapi RequestValidationError       → 400 naming the parameter (never FastAPI's raw 422 dump)
    starlette HTTPException (404, 405)   → same status, in the envelope
    swarm_client NoRouteError            → 503 + Retry-After, naming the missing blocks
    swarm_client SwarmError (others)     → 503 + Retry-After
    anything else                        → 500 (caught by ``app.RequestContextMiddleware``, which sits
                                           outside Starlette's handlers so even those get the envelope)
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from swarm_client.errors import NoRouteError, SessionTooLongError, SwarmBusyError, SwarmError

logger = logging.getLogger(__name__)

__all__ = [
    "ContextLengthExceededError",
    "GatewayError",
    "GatewayTimeoutError",
    "InvalidRequestError",
    "ModelNotFoundError",
    "ServiceUnavailableError",
    "UnsupportedParameterError",
    "error_response",
    "install_error_handlers",
    "param_from_loc",
    "to_gateway_error",
    "validation_error",
]

#: seconds a client should wait before retrying a 503; overridden from settings by ``install_error_handlers``
DEFAULT_RETRY_AFTER_S = 5


class GatewayError(Exception):
    """An error with an HTTP status and OpenAI's ``type``/``code``/``param``."""

    status_code = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {}


class InvalidRequestError(GatewayError):
    status_code = 400
    type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"

    def __init__(self, *, max_context: int, prompt_tokens: int, completion_tokens: int, param: str):
        where = "messages" if param == "messages" else "prompt"
        super().__init__(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the {where}, "
            f"{completion_tokens} in the completion). Please reduce the length of the {where} or completion.",
            param=param,
        )


class UnsupportedParameterError(InvalidRequestError):
    code = "unsupported_parameter"

    def __init__(self, param: str, why: str = "is not supported by this server"):
        super().__init__(f"Unsupported parameter: '{param}' {why}.", param=param)


class ModelNotFoundError(GatewayError):
    status_code = 404
    type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model: str, available: Sequence[str] = ()):
        listed = f" Available models: {', '.join(available)}." if available else ""
        super().__init__(
            f"The model `{model}` does not exist or you do not have access to it.{listed}", param="model"
        )


class ServiceUnavailableError(GatewayError):
    status_code = 503
    type = "service_unavailable_error"
    code = "service_unavailable"

    def __init__(self, message: str, *, code: str | None = None, retry_after_s: int | None = None):
        super().__init__(message, code=code)
        self.retry_after_s = DEFAULT_RETRY_AFTER_S if retry_after_s is None else retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class GatewayTimeoutError(GatewayError):
    status_code = 504
    type = "timeout_error"
    code = "timeout"


_UNION_TAG = re.compile(r"^[A-Za-z_][\w]*\[.*\]$|^(str|int|float|bool|dict|list|none|function-\w+)$")


def param_from_loc(loc: Sequence[int | str]) -> str | None:
    """``("messages", 0, "content", "list[Part]", 1)`` → ``"messages[0].content"``: a dotted param name
    as OpenAI writes it, stopping at pydantic's union-branch tags, which mean nothing to a client."""
    out = ""
    for part in loc:
        if part in ("body", "query", "path", "header", "cookie") and not out:
            continue  # FastAPI's source prefix
        if isinstance(part, int):
            out += f"[{part}]"
        elif _UNION_TAG.match(part) or not part.isidentifier():
            break
        else:
            out += f".{part}" if out else part
    return out or None


def validation_error(errors: Sequence[Any]) -> InvalidRequestError:
    """The first pydantic error as a 400 naming its parameter (the others are usually its echoes)."""
    if not errors:
        return InvalidRequestError("Invalid request.")
    # a union's branches each fail; the most specific (longest loc) message is the most helpful one
    first_loc = tuple(errors[0].get("loc", ()))
    param = param_from_loc(first_loc)
    same_param = [e for e in errors if param_from_loc(tuple(e.get("loc", ()))) == param]
    # a type mismatch is usually another branch of a union failing (``stop``: "not a string" when the list
    # has 5 entries): an error about the value itself says more
    best = max(
        same_param or [errors[0]],
        key=lambda e: (not str(e.get("type", "")).endswith("_type"), len(e.get("loc", ()))),
    )
    msg = best.get("msg", "Invalid value")
    if best.get("type") == "missing":
        msg = "Field required"
    return InvalidRequestError(f"{param}: {msg}" if param else msg, param=param)


def to_gateway_error(exc: BaseException, *, retry_after_s: int | None = None) -> GatewayError:
    """Translate any exception into the ``GatewayError`` that describes it to a client."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, NoRouteError):
        blocks = _ranges(exc.missing_blocks)
        message = f"The swarm cannot serve this model right now: {exc}"
        if blocks and blocks not in str(exc):
            message += f" (no server holds blocks {blocks})"
        return ServiceUnavailableError(message, code="no_route", retry_after_s=retry_after_s)
    if isinstance(exc, SwarmBusyError):
        wait = max(1, math.ceil(exc.retry_after)) if retry_after_s is None else retry_after_s
        return ServiceUnavailableError(
            f"The swarm is at capacity: {exc}", code="swarm_busy", retry_after_s=wait
        )
    if isinstance(exc, SessionTooLongError):
        return InvalidRequestError(
            f"The swarm's servers cannot hold this request: {exc}", param="max_tokens", code="session_too_long"
        )
    if isinstance(exc, SwarmError):
        return ServiceUnavailableError(
            f"The swarm failed to serve this request: {type(exc).__name__}: {exc}",
            code="swarm_error",
            retry_after_s=retry_after_s,
        )
    if isinstance(exc, ValidationError):
        return validation_error(exc.errors(include_url=False))
    if isinstance(exc, RequestValidationError):
        return validation_error(list(exc.errors()))
    if isinstance(exc, StarletteHTTPException):
        err = GatewayError(str(exc.detail))
        err.status_code = exc.status_code
        err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        err.code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return err
    return GatewayError("The server had an error while processing your request.", code="internal_error")


def error_response(exc: BaseException, *, retry_after_s: int | None = None) -> JSONResponse:
    err = to_gateway_error(exc, retry_after_s=retry_after_s)
    return JSONResponse(err.payload(), status_code=err.status_code, headers=err.headers())


def install_error_handlers(app: FastAPI, *, retry_after_s: int = DEFAULT_RETRY_AFTER_S) -> None:
    """One handler per exception base class; each answers in the OpenAI envelope."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        err = to_gateway_error(exc, retry_after_s=retry_after_s)
        level = logging.WARNING if err.status_code >= 500 else logging.INFO
        logger.log(level, "%s %s → %d %s", request.method, request.url.path, err.status_code, err.message)
        headers = err.headers()
        if isinstance(exc, StarletteHTTPException) and exc.headers:  # e.g. a 405's Allow
            headers = {**exc.headers, **headers}
        return JSONResponse(err.payload(), status_code=err.status_code, headers=headers)

    for cls in (GatewayError, RequestValidationError, StarletteHTTPException, SwarmError):
        app.add_exception_handler(cls, handle)


def _ranges(blocks: Sequence[int]) -> str:
    """[0, 1, 2, 5] → "0-2, 5": readable in an error message even for a 80-block model."""
    out: list[str] = []
    ordered = sorted(set(blocks))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ", ".join(out)
