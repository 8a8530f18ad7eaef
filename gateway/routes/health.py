"""``/health`` (200 when every block of the model is served, else 503 naming the missing ones) and
``/v1/swarm`` (the backend's ``swarm_state()`` as is; 503 when the DHT cannot be read).

``swarm_state()`` is read for ``missing_blocks`` (list of block indices nobody serves) and, when that key is
absent, derived from ``num_blocks`` and ``blocks``/``spans`` if present; a backend that says nothing of
blocks (an in-process model) is healthy.
"""

import asyncio
import inspect
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.errors import ServiceUnavailableError
from gateway.routes.deps import BackendDep, SettingsDep
from swarm_client.errors import SwarmError

router = APIRouter(tags=["swarm"])


def missing_blocks(state: dict[str, Any]) -> list[int]:
    if "missing_blocks" in state:
        return sorted(int(b) for b in state["missing_blocks"])
    num_blocks = state.get("num_blocks")
    spans = state.get("spans")
    if isinstance(num_blocks, int) and isinstance(spans, list):
        covered = {
            b
            for s in spans
            if str(s.get("state", "ONLINE")).upper() == "ONLINE"
            for b in range(s["start"], s["end"])
        }
        return [b for b in range(num_blocks) if b not in covered]
    return []


#: how old a swarm view ``/health`` and ``/v1/swarm`` may answer from (probes and pages poll them: one DHT
#: read per interval serves them all, and never waits on the event loop)
STATE_MAX_AGE_S = 2.0


def _recent_state(backend: Any) -> dict[str, Any]:
    """The backend's swarm state, at most ``STATE_MAX_AGE_S`` old where it can say so (the swarm backend)."""
    if "max_age_s" in inspect.signature(backend.swarm_state).parameters:
        return backend.swarm_state(max_age_s=STATE_MAX_AGE_S)
    return backend.swarm_state()  # a backend whose view is always current (in-process, tests' fakes)


@router.get("/health")
async def health(backend: BackendDep, settings: SettingsDep) -> JSONResponse:
    retry = {"Retry-After": str(settings.retry_after_s)}
    try:
        state = await asyncio.to_thread(_recent_state, backend)
    except Exception as exc:  # a DHT that cannot be read is a swarm we cannot vouch for
        return JSONResponse(
            {"status": "unavailable", "model": backend.model_id, "error": f"{type(exc).__name__}: {exc}"},
            status_code=503,
            headers=retry,
        )
    missing = missing_blocks(state)
    body = {
        "status": "ok" if not missing else "unavailable",
        "model": backend.model_id,
        "missing_blocks": missing,
    }
    if "num_blocks" in state:
        body["num_blocks"] = state["num_blocks"]
    if missing:
        return JSONResponse(body, status_code=503, headers=retry)
    return JSONResponse(body)


@router.get("/v1/swarm")
async def swarm(backend: BackendDep, settings: SettingsDep) -> JSONResponse:
    """The swarm state; 503 in the error envelope when the DHT cannot be read (a bug stays a 500)."""
    try:
        state = await asyncio.to_thread(_recent_state, backend)
    except (SwarmError, OSError, TimeoutError) as exc:
        raise ServiceUnavailableError(
            f"Cannot read the swarm's DHT right now: {type(exc).__name__}: {exc}",
            code="swarm_unavailable",
            retry_after_s=settings.retry_after_s,
        ) from exc
    return JSONResponse(state)
