"""``/health`` (200 when every block of the model is served, else 503 naming the missing ones) and
``/v1/swarm`` (the backend's ``swarm_state()`` as is; 503 when the DHT cannot be read).

``/health``'s ``status``: "ok"; "degraded" (still 200: requests are taken, and wait in the gateway's line
for room) when every block is served but no server of some block has room for a new session right now —
``full_blocks`` names them and ``cache`` gives the swarm's KV-cache figures (``gateway/backends/swarm_view.py``);
"unavailable" (503 + Retry-After) when blocks are missing, when no route can be made (``unroutable_blocks``:
every ONLINE server of a block is banned by this gateway; ``reason`` says why) or the DHT cannot be read.

``swarm_state()`` is read for ``missing_blocks`` (list of block indices nobody serves) and, when that key is
absent, derived from ``num_blocks`` and ``blocks``/``spans`` if present; a backend that says nothing of
blocks (an in-process model) is healthy.

Both answer from ``app.state.swarm_view`` (gateway/backends/swarm_view.py): the DHT is read on a thread of its own,
once for a whole flood of probes, and a view at most ``STATE_MAX_AGE_S`` old answers without a read.
"""

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from gateway.backends.adapters import public_model_id
from gateway.backends.swarm_view import STATE_MAX_AGE_S, SwarmView
from gateway.errors import ServiceUnavailableError
from gateway.routes.deps import BackendDep, SettingsDep
from swarm_client.errors import SwarmError

__all__ = ["STATE_MAX_AGE_S", "missing_blocks", "router"]

router = APIRouter(tags=["swarm"])


def missing_blocks(state: dict[str, Any]) -> list[int]:
    if "missing_blocks" in state:
        return sorted(int(b) for b in state["missing_blocks"])
    num_blocks = state.get("num_blocks")
    spans = state.get("spans")
    if isinstance(num_blocks, int) and isinstance(spans, list):
        covered = {
            b for s in spans if str(s.get("state", "ONLINE")).upper() == "ONLINE" for b in range(s["start"], s["end"])
        }
        return [b for b in range(num_blocks) if b not in covered]
    return []


def _view(request: Request) -> SwarmView:
    return request.app.state.swarm_view


ViewDep = Annotated[SwarmView, Depends(_view)]


@router.get("/health")
async def health(view: ViewDep, backend: BackendDep, settings: SettingsDep) -> JSONResponse:
    retry = {"Retry-After": str(settings.retry_after_s)}
    model = public_model_id(backend.model_id)  # never a filesystem path
    try:
        state = await view.get()
    except Exception as exc:  # a DHT that cannot be read is a swarm we cannot vouch for
        error = f"{type(exc).__name__}: {exc}".replace(backend.model_id, model)
        return JSONResponse(
            {"status": "unavailable", "model": model, "error": error},
            status_code=503,
            headers=retry,
        )
    missing = missing_blocks(state)
    unroutable = [int(b) for b in state.get("unroutable_blocks") or []]
    cache = state.get("cache") if isinstance(state.get("cache"), dict) else None
    full = list(cache.get("full_blocks", [])) if cache else []
    body = {
        "status": "unavailable" if missing or unroutable else "degraded" if full else "ok",
        "model": model,
        "missing_blocks": missing,
    }
    if unroutable:
        body["unroutable_blocks"] = unroutable
        body["reason"] = state.get("unroutable_reason", "no route can be made")
    if "num_blocks" in state:
        body["num_blocks"] = state["num_blocks"]
    if cache is not None:
        body["full_blocks"] = full
        body["cache"] = cache
    if missing or unroutable:
        return JSONResponse(body, status_code=503, headers=retry)
    return JSONResponse(body)


@router.get("/v1/swarm")
async def swarm(view: ViewDep, settings: SettingsDep) -> JSONResponse:
    """The swarm state; 503 in the error envelope when the DHT cannot be read (a bug stays a 500)."""
    try:
        state = await view.get()
    except (SwarmError, OSError, TimeoutError) as exc:
        raise ServiceUnavailableError(
            f"Cannot read the swarm's DHT right now: {type(exc).__name__}: {exc}",
            code="swarm_unavailable",
            retry_after_s=settings.retry_after_s,
        ) from exc
    if isinstance(state.get("model"), str):  # the backend's id may be a path: shown by its name
        state = {**state, "model": public_model_id(state["model"])}
    return JSONResponse(state)
