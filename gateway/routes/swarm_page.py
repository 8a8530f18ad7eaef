"""``/swarm``: a human-readable status page over ``/v1/swarm`` (coverage per block, servers, health).

The page is one self-contained file (``gateway/static/swarm.html``: inline CSS and JS, no CDN, so it works
on an offline swarm); it polls ``/v1/swarm`` in the browser and says so in plain words when that fails.
"""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["swarm"])


@functools.lru_cache(maxsize=8)
def _page_html(name: str) -> str:
    return resources.files("gateway").joinpath("static", name).read_text(encoding="utf-8")


def static_page(name: str) -> HTMLResponse:
    """One of the self-contained pages in ``gateway/static`` (read once), never cached by the browser."""
    return HTMLResponse(_page_html(name), headers={"Cache-Control": "no-cache"})


@router.get("/swarm", response_class=HTMLResponse, include_in_schema=False)
async def swarm_page() -> HTMLResponse:
    return static_page("swarm.html")
