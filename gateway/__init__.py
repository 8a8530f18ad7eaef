"""The OpenAI-compatible HTTP gateway: ``create_app(backend, settings)`` serves any ``ModelBackend``.

Public names are exported lazily so that ``import gateway`` (the CLI does it) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["BackgroundServer", "GatewaySettings", "LocalBackend", "create_app", "serve"]

_WHERE = {
    "BackgroundServer": "gateway.server",
    "GatewaySettings": "gateway.settings",
    "LocalBackend": "gateway.backends.local",
    "create_app": "gateway.app",
    "serve": "gateway.server",
}

if TYPE_CHECKING:
    from gateway.app import create_app
    from gateway.backends.local import LocalBackend
    from gateway.server import BackgroundServer, serve
    from gateway.settings import GatewaySettings


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'gateway' has no attribute {name!r}")
