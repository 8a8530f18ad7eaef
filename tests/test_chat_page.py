"""The ``/chat`` page in a real headless Chromium (Playwright), and the route/speed response headers.

Over a real swarm (a DHT and two workers: blocks 0:2 and 2:4 of a tiny Llama, ``SwarmBackend``, uvicorn):
the page streams a reply, shows its route, and Stop cancels the request so both servers drop the session.
Over ``LocalBackend`` with API keys: the page works with the key field and shows the 401 of a wrong key.

Chromium is Debian's ``chromium`` package, driven by the ``playwright`` package (no ``playwright install``:
``executable_path`` points at ``/usr/bin/chromium``); without either the browser cases are skipped (they fail
under ``SWARMSERVE_REQUIRE=chromium``). Screenshots go to ``$SWARMSERVE_ARTIFACTS`` if set, else pytest's
temporary directory; each test prints where.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway import LocalBackend
from gateway.api.route_info import PUSH_HEADER, ROUTE_HEADER, SPEED_HEADER
from gateway.backends.swarm import SwarmBackend
from gateway.decode.engine import eos_token_ids
from tests.conftest import require_or_skip
from tests.gateway_fixtures import Gateway, start_gateway, swarm_gateway
from tests.swarm_fixtures import Swarm, swarm

CHROMIUM = "/usr/bin/chromium"
SPANS = ["0:2", "2:4"]
KEY = "sk-chat-page-test"
HELLO = [{"role": "user", "content": "Tell me about the swarm."}]


def _wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def _artifact(tmp_path: Path, name: str) -> Path:
    root = Path(os.environ["SWARMSERVE_ARTIFACTS"]) if os.environ.get("SWARMSERVE_ARTIFACTS") else tmp_path
    root.mkdir(parents=True, exist_ok=True)
    return root / name


# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def keyed_gw(tiny_llama: str) -> Iterator[Gateway]:
    """``LocalBackend`` with an API key; the page itself is served without one (it holds no secret)."""
    backend = LocalBackend(tiny_llama)
    gw = start_gateway(backend, api_keys=[KEY])  # /chat is exempt by default
    yield gw
    gw.server.stop()
    backend.close()


@pytest.fixture(scope="module")
def the_swarm(tiny_llama: str) -> Iterator[Swarm]:
    # a fixed throughput skips the workers' benchmark and makes routing deterministic
    with swarm(tiny_llama, SPANS, "--throughput", "1000") as s:
        yield s


@pytest.fixture(scope="module")
def swarm_gw(the_swarm: Swarm, tiny_llama: str) -> Iterator[Gateway]:
    with swarm_gateway(tiny_llama, the_swarm.initial_peers) as gw:
        yield gw


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not os.path.exists(CHROMIUM):
        require_or_skip("chromium", f"{CHROMIUM} is missing")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        require_or_skip("chromium", "the playwright package is missing (pip install playwright)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    pg = context.new_page()
    pg.set_default_timeout(20_000)
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def _route_hops(gw: Gateway, the_swarm: Swarm) -> str:
    """What ``x-swarm-route`` must say for the two workers: ``peer[0:2], peer[2:4]``."""
    by_span = {w.span_text: w.peer_id for w in the_swarm.workers}
    return ", ".join(f"{by_span[s]}[{s}]" for s in SPANS)


# ---------------------------------------------------------------------------------------- no browser


def test_page_is_served_self_contained_and_escapes(keyed_gw: Gateway) -> None:
    with keyed_gw.http() as http:
        r = http.get("/chat")  # no key: the page is exempt here, the API is not
        assert http.get("/v1/models").status_code == 401
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|@import|url\(\s*["']?(https?:)?//""", r.text)
    assert not re.search(r"https?://", r.text)  # no CDN, no external URL of any kind
    assert "innerHTML" not in r.text and "insertAdjacentHTML" not in r.text  # model text is textContent


def test_local_backend_headers_and_cors(keyed_gw: Gateway) -> None:
    auth = {"Authorization": f"Bearer {KEY}", "Origin": "http://elsewhere.example"}
    body = {"model": keyed_gw.model, "messages": HELLO, "max_tokens": 8, "temperature": 0}
    with keyed_gw.http() as http:
        r = http.post("/v1/chat/completions", json=body, headers=auth)
        assert r.status_code == 200, r.text
        assert (r.headers[ROUTE_HEADER], r.headers[PUSH_HEADER]) == ("local", "false")
        tokens = r.json()["usage"]["completion_tokens"]
        assert tokens > 0 and float(r.headers[SPEED_HEADER]) > 0
        exposed = {h.strip() for h in r.headers["access-control-expose-headers"].split(",")}
        assert {ROUTE_HEADER, PUSH_HEADER, SPEED_HEADER} <= exposed
        c = http.post(
            "/v1/completions",
            json={"model": keyed_gw.model, "prompt": "The swarm", "max_tokens": 4, "stream": True},
            headers=auth,
        )
        assert c.status_code == 200 and c.headers[ROUTE_HEADER] == "local"
        assert SPEED_HEADER not in c.headers  # a stream's speed is the client's to count


# ------------------------------------------------------------------------------------------- browser


def test_page_with_api_keys(keyed_gw: Gateway, page: Any, tmp_path: Path) -> None:
    page.goto(f"{keyed_gw.url}/chat")
    error = page.locator("#error")
    error.filter(has_text="401").wait_for()  # no key yet: /v1/models says why, readably
    assert "API key" in error.inner_text()

    page.fill("#api-key", "sk-wrong")
    page.fill("#prompt", "Hello?")
    page.click("#send")
    reply = page.locator(".msg.assistant").last
    page.wait_for_function("document.querySelector('.msg.assistant').dataset.state === 'error'")
    assert re.search(r"Error 401: .*Check the API key field", reply.inner_text())

    page.fill("#api-key", KEY)
    page.locator("#api-key").dispatch_event("change")  # saved, and the models reload with it
    page.locator("#model option", has_text=keyed_gw.model).wait_for(state="attached")
    assert page.evaluate("localStorage.getItem('swarmserve.apiKey')") == KEY
    page.fill("#max-tokens", "8")
    page.fill("#prompt", "Hello again, <b>not bold</b>")
    page.click("#send")
    page.wait_for_function("[...document.querySelectorAll('.msg.assistant')].pop().dataset.state === 'done'")
    last = page.locator(".msg.assistant").last
    assert last.get_attribute("data-route") == "local"
    assert "route: local" in last.locator(".meta").inner_text()
    assert page.locator(".msg.user b").count() == 0  # the user's text is text, not markup
    shot = _artifact(tmp_path, "chat-page-keys.png")
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")


@pytest.mark.slow
def test_swarm_route_headers(swarm_gw: Gateway, the_swarm: Swarm) -> None:
    expected = _route_hops(swarm_gw, the_swarm)
    chat = {"model": swarm_gw.model, "messages": HELLO, "max_tokens": 8, "temperature": 0}
    with swarm_gw.http() as http:
        r = http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        assert r.headers[ROUTE_HEADER] == expected
        # push="auto": on when the second server's measured RTT reaches push_min_rtt (a ping through two p2p
        # daemons on 2 loaded cores may), so the header must say what that rule says for this route
        manager = swarm_gw.backend.manager
        second = next(w.peer_id for w in the_swarm.workers if w.span_text == SPANS[1])
        pays = manager.rtt.get(second, float("inf")) >= manager.config.push_min_rtt
        assert r.headers[PUSH_HEADER] == ("true" if pays else "false"), (manager.rtt, r.headers[PUSH_HEADER])
        assert float(r.headers[SPEED_HEADER]) > 0
        with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
            assert s.status_code == 200 and s.headers[ROUTE_HEADER] == expected
            assert SPEED_HEADER not in s.headers
            s.read()
        c = http.post("/v1/completions", json={"model": swarm_gw.model, "prompt": "The swarm", "max_tokens": 4})
        assert c.status_code == 200 and c.headers[ROUTE_HEADER] == expected
    _wait_for(lambda: swarm_gw.backend.open_sessions == 0, 10, "the gateway to close its sessions")


@pytest.mark.slow
def test_page_streams_shows_route_and_stop_cancels(
    swarm_gw: Gateway, the_swarm: Swarm, page: Any, tmp_path: Path
) -> None:
    backend: SwarmBackend = swarm_gw.backend
    peers = [w.peer_id for w in the_swarm.workers]
    _wait_for(lambda: backend.open_sessions == 0, 10, "earlier requests to finish")
    before = [backend.server_info(p) for p in peers]

    page.goto(f"{swarm_gw.url}/chat")
    page.locator("#model option", has_text=swarm_gw.model).wait_for(state="attached")
    page.fill("#max-tokens", "1500")
    # the tiny model soon ends a reply with EOS: banned, the reply runs until Stop
    page.click("details summary")
    page.fill("#extra", json.dumps({"logit_bias": {str(i): -100 for i in eos_token_ids(backend)}}))
    page.fill("#prompt", "Tell me a long story about the swarm.")
    page.click("#send")

    reply = page.locator(".msg.assistant").last
    page.wait_for_function(
        "(() => { const m = document.querySelector('.msg.assistant');"
        " return m.dataset.state === 'streaming' && m.querySelector('.text').textContent.length > 40; })()"
    )
    assert re.search(r"\d+ tokens · [\d.]+ tok/s", reply.locator(".speed").inner_text())
    # mid-stream: both servers hold this session's cache
    assert all(backend.server_info(p)["sessions_attached"] == 1 for p in peers)
    shown = reply.locator(".route")
    assert reply.get_attribute("data-route") == _route_hops(swarm_gw, the_swarm)
    for peer, span in zip(peers, SPANS, strict=True):
        assert shown.get_attribute("title").count(peer) == 1 and f"[{span}]" in shown.inner_text()

    page.click("#stop")
    page.wait_for_function("document.querySelector('.msg.assistant').dataset.state === 'stopped'")
    assert "stopped" in reply.locator(".speed").inner_text()
    shot = _artifact(tmp_path, "chat-page-swarm.png")
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")

    def freed() -> bool:
        infos = [backend.server_info(p) for p in peers]
        return all(
            i["sessions_attached"] == 0 and i["sessions_detached"] <= b["sessions_detached"]
            for i, b in zip(infos, before, strict=True)
        )

    _wait_for(freed, 20, "the servers to drop the stopped reply's session")
    _wait_for(lambda: backend.open_sessions == 0, 10, "the gateway to forget the session")
    text = reply.locator(".text").inner_text()
    assert len(text) > 40  # what streamed before Stop stays on the page
