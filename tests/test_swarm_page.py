"""The ``/swarm`` status page, rendered by a real headless Chromium, over fake backends: one whose swarm
has three servers and a gap, one whose DHT cannot be read (the page must say so, not break), plus the
``/v1/swarm`` 503 contract the page relies on.

Chromium is Debian's ``chromium`` package; without ``/usr/bin/chromium`` the browser cases are skipped (they
fail under ``SWARMSERVE_REQUIRE=chromium``, as in CI).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from swarm_client.errors import NoRouteError, PeerError
from tests.conftest import require_or_skip
from tests.gateway_fixtures import Gateway, temporary_gateway, tiny_tokenizer

CHROMIUM = "/usr/bin/chromium"
NUM_BLOCKS = 6
SPANS = [
    {"peer_id": "12D3KooWAlphaAAAAbbbbCCCCddddEEEEffff11111111", "start": 0, "end": 3, "state": "ONLINE",
     "throughput": 12.5, "cache_tokens_left": 1000, "public_name": "alpha", "reachability": "direct"},
    {"peer_id": "12D3KooWBravoAAAAbbbbCCCCddddEEEEffff22222222", "start": 2, "end": 5, "state": "ONLINE",
     "throughput": 30.0, "cache_tokens_left": 500, "public_name": None, "reachability": "unreachable from here"},
    {"peer_id": "12D3KooWCharlieAAAbbbbCCCCddddEEEEffff3333333", "start": 5, "end": 6, "state": "JOINING",
     "throughput": 5.0, "cache_tokens_left": 0, "public_name": None},
]  # fmt: skip
#: ONLINE servers per block for SPANS: block 5 only has a JOINING server, so it is a gap
SERVERS_PER_BLOCK = [1, 1, 2, 1, 1, 0]


class FakeSwarmBackend:
    """``swarm_state`` as ``SwarmBackend`` shapes it, or raising what ``SwarmBackend`` raises when the DHT
    is unreadable (``PeerError``)."""

    def __init__(self, broken: bool = False):
        self.model_id = "tiny-llama"
        self.tokenizer = tiny_tokenizer()
        self.max_context = 2048
        self.broken = broken

    def open_session(self, max_length: int, session_id: str | None = None) -> Any:
        raise NoRouteError("no server holds block 5", missing_blocks=[5])

    def swarm_state(self) -> dict:
        if self.broken:
            raise PeerError("swarm transport failed: OSError: the p2p daemon is gone")
        return {
            "model": self.model_id,
            "backend": "swarm",
            "num_blocks": NUM_BLOCKS,
            "missing_blocks": [5],
            "spans": SPANS,
            "blocks": [[s["peer_id"] for s in SPANS if s["state"] == "ONLINE" and s["start"] <= b < s["end"]]
                       for b in range(NUM_BLOCKS)],
            "open_sessions": 1,
        }  # fmt: skip

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def healthy_gw() -> Iterator[Gateway]:
    with temporary_gateway(FakeSwarmBackend) as gw:
        yield gw


@pytest.fixture(scope="module")
def broken_gw() -> Iterator[Gateway]:
    with temporary_gateway(lambda: FakeSwarmBackend(broken=True), retry_after_s=4) as gw:
        yield gw


class Dom(HTMLParser):
    """Elements (tag, attributes) and the visible text of a dumped DOM."""

    def __init__(self, html: str):
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self._skip = 0
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}))
        self._skip += tag in ("script", "style")

    def handle_endtag(self, tag: str) -> None:
        self._skip -= tag in ("script", "style")

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.text.append(data)

    def with_class(self, name: str) -> list[dict[str, str]]:
        return [a for _, a in self.elements if name in a.get("class", "").split()]

    def by_id(self, element_id: str) -> dict[str, str]:
        return next(a for _, a in self.elements if a.get("id") == element_id)

    @property
    def visible_text(self) -> str:
        return " ".join(" ".join(self.text).split())


def chromium(url: str, tmp_path: Path, *extra: str, budget_ms: int = 5000) -> subprocess.CompletedProcess:
    if not os.path.exists(CHROMIUM):
        require_or_skip("chromium", f"{CHROMIUM} is missing")
    profile = tmp_path / f"chromium-profile-{len(list(tmp_path.iterdir()))}"
    args = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", "--window-size=1100,700",
        *extra, url,
    ]  # fmt: skip
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def render(gw: Gateway, tmp_path: Path, name: str, budget_ms: int = 5000) -> Dom:
    """The page's DOM after ``budget_ms`` of virtual time; a screenshot lands next to it for humans."""
    url = f"{gw.url}/swarm"
    chromium(url, tmp_path, f"--screenshot={tmp_path / f'{name}.png'}", budget_ms=budget_ms)
    assert (tmp_path / f"{name}.png").stat().st_size > 0
    return Dom(chromium(url, tmp_path, "--dump-dom", budget_ms=budget_ms).stdout)


# --- without a browser -------------------------------------------------------------------------------


def test_page_is_served_and_self_contained(healthy_gw: Gateway) -> None:
    with healthy_gw.http() as http:
        r = http.get("/swarm")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "/v1/swarm" in r.text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|@import|url\(\s*["']?(https?:)?//""", r.text)


def test_v1_swarm_is_a_503_envelope_when_the_dht_cannot_be_read(broken_gw: Gateway) -> None:
    with broken_gw.http() as http:
        r = http.get("/v1/swarm")
    assert r.status_code == 503
    assert r.headers["retry-after"] == "4"
    error = r.json()["error"]
    assert error["code"] == "swarm_unavailable"
    assert error["type"] == "service_unavailable_error"
    assert error["message"].startswith("Cannot read the swarm's DHT right now: PeerError: ")
    assert "p2p daemon is gone" in error["message"]


# --- in Chromium -------------------------------------------------------------------------------------


def test_page_shows_every_server_and_a_bar_per_block(healthy_gw: Gateway, tmp_path: Path) -> None:
    dom = render(healthy_gw, tmp_path, "swarm-healthy")
    rows = dom.with_class("server")
    assert [r["data-peer-id"] for r in rows] == [s["peer_id"] for s in SPANS]
    text = dom.visible_text
    for s in SPANS:
        assert s["peer_id"] in text  # the full id, as the workers, up and status print it
        assert f"{s['start']}:{s['end']}" in text
    assert "alpha" in text and "JOINING" in text
    assert len(dom.with_class("reachability")) == len(SPANS)  # one cell per server
    assert "direct" in text and "unreachable from here" in text

    bars = dom.with_class("block-bar")
    assert [int(b["data-block"]) for b in bars] == list(range(NUM_BLOCKS))
    assert [int(b["data-servers"]) for b in bars] == SERVERS_PER_BLOCK
    assert "servers-0" in bars[5]["class"] and "servers-many" in bars[2]["class"]
    assert "degraded: blocks 5 not served" in text
    assert "Cannot read" not in text
    assert "hidden" not in dom.by_id("content")


def test_page_explains_an_unreadable_dht_instead_of_breaking(broken_gw: Gateway, tmp_path: Path) -> None:
    dom = render(broken_gw, tmp_path, "swarm-unreadable", budget_ms=2000)
    text = dom.visible_text
    message = re.search(r"Cannot read the swarm's DHT right now: (.+?); retrying in (\d+)s", text)
    assert message, text
    assert "PeerError: swarm transport failed" in message.group(1) and "HTTP 503" in message.group(1)
    assert 1 <= int(message.group(2)) <= 4  # the countdown follows the 503's Retry-After
    assert "hidden" in dom.by_id("content")  # no half-drawn widgets
    assert not dom.with_class("block-bar") and not dom.with_class("server")
