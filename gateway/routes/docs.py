"""``/docs`` (Swagger UI) and ``/redoc`` with their JavaScript and CSS served by the gateway itself.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, so on an offline swarm they are blank. The assets
come from the ``fastapi-offline`` package (Swagger UI 5 — FastAPI's OpenAPI 3.1 needs it —, ReDoc 2 and
FastAPI's favicon, under their licenses) and are mounted at ``/static/docs/``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["ASSETS_URL", "install_docs"]

#: where the Swagger UI / ReDoc files are served
ASSETS_URL = "/static/docs"
DOCS_URL, REDOC_URL = "/docs", "/redoc"

router = APIRouter(include_in_schema=False)


def assets_dir() -> Path:
    """The directory of ``swagger-ui-bundle.js``, ``swagger-ui.css``, ``redoc.standalone.js``, ``favicon.png``."""
    return Path(str(resources.files("fastapi_offline") / "static"))


def _urls(request: Request) -> tuple[str, str]:
    """(openapi.json, assets) URLs, behind a proxy's ``root_path`` too."""
    root = request.scope.get("root_path", "")
    return f"{root}{request.app.openapi_url}", f"{root}{ASSETS_URL}"


@router.get(DOCS_URL)
async def swagger_ui(request: Request) -> HTMLResponse:
    openapi_url, assets = _urls(request)
    return get_swagger_ui_html(
        openapi_url=openapi_url,
        title=f"{request.app.title} - Swagger UI",
        oauth2_redirect_url=request.app.swagger_ui_oauth2_redirect_url,
        swagger_js_url=f"{assets}/swagger-ui-bundle.js",
        swagger_css_url=f"{assets}/swagger-ui.css",
        swagger_favicon_url=f"{assets}/favicon.png",
        # no "valid" badge fetched from validator.swagger.io
        swagger_ui_parameters={"validatorUrl": None, **(request.app.swagger_ui_parameters or {})},
    )


@router.get(f"{DOCS_URL}/oauth2-redirect")
async def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get(REDOC_URL)
async def redoc(request: Request) -> HTMLResponse:
    openapi_url, assets = _urls(request)
    return get_redoc_html(
        openapi_url=openapi_url,
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=f"{assets}/redoc.standalone.js",
        redoc_favicon_url=f"{assets}/favicon.png",
        with_google_fonts=False,
    )


def install_docs(app: FastAPI) -> None:
    """Serve the docs pages and their assets; create ``app`` with ``docs_url=None, redoc_url=None`` (FastAPI's
    CDN pages) and the default ``swagger_ui_oauth2_redirect_url``."""
    app.mount(ASSETS_URL, StaticFiles(directory=assets_dir()), name="docs-assets")
    app.include_router(router)
