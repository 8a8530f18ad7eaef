"""``/docs`` and ``/redoc`` work offline: their JavaScript and CSS come from the gateway, not a CDN; in a real
headless Chromium the Swagger UI page shows the API's operations.

The browser case reuses ``tests/test_swarm_page.py``'s Chromium driver (skipped without ``/usr/bin/chromium``
unless ``SWARMSERVE_REQUIRE=chromium``).
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.gateway_fixtures import Gateway, shared_gateway
from tests.test_swarm_page import Dom, chromium

OPERATIONS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model_id}", "/health", "/v1/swarm"}


class Assets(HTMLParser):
    """``src``/``href`` of ``<script>`` and ``<link>`` elements."""

    def __init__(self, html: str):
        super().__init__()
        self.urls: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        url = a.get("src") if tag == "script" else a.get("href") if tag == "link" else None
        if url:
            self.urls.append(url)


@pytest.fixture(scope="module")
def gw() -> Gateway:
    return shared_gateway()


@pytest.mark.parametrize(("page", "wanted"), [("/docs", (".js", ".css", ".png")), ("/redoc", (".js", ".png"))])
def test_docs_pages_serve_their_assets_themselves(gw: Gateway, page: str, wanted: tuple[str, ...]) -> None:
    with gw.http() as http:
        r = http.get(page)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert not re.search(r"https?://", r.text), "the page names something on another host"
        urls = Assets(r.text).urls
        assert {Path(u).suffix for u in urls} >= set(wanted), urls
        for url in urls:
            assert url.startswith("/static/docs/"), url
            asset = http.get(url)
            assert asset.status_code == 200, url
            assert len(asset.content) > 1000, url
        assert http.get("/openapi.json").status_code == 200


def test_swagger_ui_shows_the_operations_in_chromium(gw: Gateway, tmp_path: Path) -> None:
    url = f"{gw.url}/docs"
    chromium(url, tmp_path, f"--screenshot={tmp_path / 'docs.png'}", "--window-size=1280,900")
    assert (tmp_path / "docs.png").stat().st_size > 10_000  # blank pages are a few KB
    dom = Dom(chromium(url, tmp_path, "--dump-dom").stdout)
    paths = {a["data-path"] for a in dom.with_class("opblock-summary-path")}
    assert paths >= OPERATIONS, paths
    assert "swarmserve" in dom.visible_text
