"""HTTP routers: each a few lines that hand a parsed request to ``gateway.serving`` or the backend."""

from gateway.routes import chat, completions, health, models, responses

ROUTERS = (chat.router, completions.router, models.router, health.router, responses.router)

__all__ = ["ROUTERS"]
