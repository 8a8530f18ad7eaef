"""API keys: ``Authorization: Bearer <key>`` on every path but the exempt ones (``/health``, ``/metrics``).

Keys come from ``SWARMSERVE_API_KEYS`` (comma-separated) and/or a file (``--api-keys-file``: one key per
line, ``#`` starts a comment). No key configured means an open gateway — the local, embedded default.
A missing or wrong key is a 401 in OpenAI's envelope, code ``invalid_api_key``, with
``WWW-Authenticate: Bearer``.

Keys are held as SHA-256 digests and a presented key is compared by its digest, so the check takes the
same time whichever byte differs. The request's key id (a digest prefix, never the key) is left in
``scope["state"]["api_key_id"]`` for the rate limiter.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from pathlib import Path

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import GatewayError, error_response

logger = logging.getLogger(__name__)

__all__ = [
    "APIKeys",
    "AuthMiddleware",
    "InvalidAPIKeyError",
    "bearer_token",
    "key_id",
    "load_api_keys",
    "owner_of",
    "parse_key_file",
]


class InvalidAPIKeyError(GatewayError):
    status_code = 401
    type = "invalid_request_error"
    code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


def parse_key_file(text: str) -> list[str]:
    """One key per line; blank lines and ``#`` comments (whole-line or trailing) are skipped."""
    keys = []
    for line in text.splitlines():
        key = line.split("#", 1)[0].strip()
        if key:
            keys.append(key)
    return keys


def load_api_keys(keys: Iterable[str] = (), keys_file: str | Path | None = None) -> list[str]:
    """The configured keys: ``keys`` plus those of ``keys_file`` (which must exist if named)."""
    out = [k.strip() for k in keys if k.strip()]
    if keys_file is not None:
        out += parse_key_file(Path(keys_file).expanduser().read_text(encoding="utf-8"))
    return out


def key_id(key: str) -> str:
    """A stable, non-secret name for a key: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def bearer_token(headers: Headers) -> str | None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class APIKeys:
    """The set of accepted keys (as digests)."""

    def __init__(self, keys: Iterable[str]):
        self._digests = frozenset(hashlib.sha256(k.encode()).digest() for k in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def accepts(self, key: str) -> bool:
        return hashlib.sha256(key.encode()).digest() in self._digests


def _exempt(path: str, exempt: Iterable[str]) -> bool:
    """Exact paths, or prefixes written ``/docs*``."""
    return any(path.startswith(p[:-1]) if p.endswith("*") else path == p for p in exempt)


class AuthMiddleware:
    """Refuses requests without an accepted key; an empty ``keys`` lets everything through."""

    def __init__(self, app: ASGIApp, keys: APIKeys, exempt_paths: Iterable[str] = ("/health", "/metrics")):
        self.app = app
        self.keys = keys
        self.exempt_paths = tuple(exempt_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)  # OPTIONS: CORS preflights carry no credentials
            return
        if _exempt(scope.get("path", ""), self.exempt_paths):
            await self.app(scope, receive, send)
            return
        token = bearer_token(Headers(scope=scope))
        if token is None:
            err = InvalidAPIKeyError(
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        elif not self.keys.accepts(token):
            err = InvalidAPIKeyError(f"Incorrect API key provided: {_redact(token)}.")
        else:
            scope.setdefault("state", {})["api_key_id"] = key_id(token)
            await self.app(scope, receive, send)
            return
        logger.info("%s %s → 401 (%s)", scope.get("method"), scope.get("path"), err.message)
        await error_response(err)(scope, receive, send)


def _redact(key: str) -> str:
    """OpenAI's style: enough of the key to recognize it, not enough to use it."""
    return f"{key[:3]}***{key[-4:]}" if len(key) > 10 else "***"


def owner_of(request: Request) -> str | None:
    """The API key id the auth middleware left; on an open gateway, the sent bearer token's id, if any."""
    given = request.scope.get("state", {}).get("api_key_id")
    if given:
        return str(given)
    token = bearer_token(Headers(scope=request.scope))
    return key_id(token) if token else None
