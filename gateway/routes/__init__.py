"""HTTP routers: each a few lines that hand a parsed request to ``gateway.serving`` or the backend."""

from gateway.routes import chat, completions, health, models

ROUTERS = (chat.router, completions.router, models.router, health.router)

__all__ = ["ROUTERS"]
