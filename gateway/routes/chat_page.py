"""``/chat``: a chat page over ``/v1/chat/completions`` (model picker, API key, streamed replies, Stop).

One self-contained file (``gateway/static/chat.html``: inline CSS and JS, no CDN, so it works on an offline
swarm). It streams with ``fetch`` and shows each reply's route (the ``x-swarm-route`` header,
gateway/api/route_info.py) and tokens/s; Stop aborts the fetch, and the gateway then cancels the request and
frees the servers' caches. A random ``X-Session-Id`` per conversation lets follow-ups reuse those caches.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from gateway.routes.swarm_page import static_page

router = APIRouter(tags=["chat"])


@router.get("/chat", response_class=HTMLResponse, include_in_schema=False)
async def chat_page() -> HTMLResponse:
    return static_page("chat.html")
