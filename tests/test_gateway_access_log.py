"""The access log: one INFO line per finished request on ``gateway.access``, with the request id, method,
path, status, token counts and duration — for a plain and a streamed chat completion and for a 4xx."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid

import pytest

from tests.gateway_fixtures import Gateway, shared_gateway

HELLO = [{"role": "user", "content": "Hello there"}]
LINE = re.compile(
    r'^(?P<rid>\S+) (?P<client>\S+) "(?P<method>[A-Z]+) (?P<path>\S+)" (?P<status>\d{3}) '
    r"prompt_tokens=(?P<prompt>\d+|-) completion_tokens=(?P<completion>\d+|-) cached_tokens=(?P<cached>\d+|-) "
    r"(?P<ms>\d+\.\d)ms$"
)


@pytest.fixture(scope="module")
def gw() -> Gateway:
    return shared_gateway()


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="gateway.access")
    return caplog


def _line(caplog: pytest.LogCaptureFixture, request_id: str, timeout: float = 10.0) -> re.Match[str]:
    """The access line of ``request_id``: the server thread writes it after the response's last byte, so
    the client may see the response first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [
            r for r in caplog.records if r.name == "gateway.access" and getattr(r, "request_id", None) == request_id
        ]
        if found:
            assert len(found) == 1, [r.getMessage() for r in found]
            assert found[0].levelno == logging.INFO
            match = LINE.match(found[0].getMessage())
            assert match, found[0].getMessage()
            assert match["rid"] == request_id
            return match
        time.sleep(0.02)
    raise AssertionError(f"no access line for {request_id}")


def _rid() -> str:
    return f"test-access-{uuid.uuid4().hex[:12]}"


def test_plain_chat_completion_is_logged_with_its_usage(gw: Gateway, access: pytest.LogCaptureFixture) -> None:
    rid = _rid()
    with gw.http() as http:
        r = http.post(
            "/v1/chat/completions",
            json={"model": gw.model, "messages": HELLO, "max_tokens": 5},
            headers={"x-request-id": rid},
        )
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    usage = r.json()["usage"]
    line = _line(access, rid)
    assert (line["method"], line["path"], line["status"], line["client"]) == (
        "POST",
        "/v1/chat/completions",
        "200",
        "127.0.0.1",
    )
    assert int(line["prompt"]) == usage["prompt_tokens"]
    assert int(line["completion"]) == usage["completion_tokens"]
    assert int(line["cached"]) == usage["prompt_tokens_details"]["cached_tokens"]
    assert float(line["ms"]) > 0


def test_streamed_chat_completion_is_logged_when_the_stream_ends(gw: Gateway, access: pytest.LogCaptureFixture) -> None:
    rid = _rid()
    body = {
        "model": gw.model,
        "messages": HELLO,
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = None
    with gw.http() as http, http.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": rid}) as r:
        assert r.status_code == 200
        for raw in r.iter_lines():
            if raw.startswith("data: {"):
                usage = json.loads(raw.removeprefix("data: ")).get("usage") or usage
    assert usage is not None
    line = _line(access, rid)
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/chat/completions", "200")
    assert int(line["prompt"]) == usage["prompt_tokens"]
    assert int(line["completion"]) == usage["completion_tokens"]


def test_client_error_is_logged_without_tokens(gw: Gateway, access: pytest.LogCaptureFixture) -> None:
    rid = _rid()
    with gw.http() as http:
        r = http.post(
            "/v1/chat/completions",
            json={"model": gw.model, "messages": HELLO, "max_tokens": -1},
            headers={"x-request-id": rid},
        )
    assert r.status_code == 400
    line = _line(access, rid)
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/chat/completions", "400")
    assert (line["prompt"], line["completion"], line["cached"]) == ("-", "-", "-")


def test_unknown_path_is_logged_too(gw: Gateway, access: pytest.LogCaptureFixture) -> None:
    rid = _rid()
    with gw.http() as http:
        r = http.get("/v1/nothing-here?secret=1", headers={"x-request-id": rid})
    assert r.status_code == 404
    line = _line(access, rid)
    assert (line["method"], line["path"], line["status"]) == ("GET", "/v1/nothing-here", "404")
