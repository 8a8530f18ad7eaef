"""The SSE wire format byte by byte, errors after the 200, and what a client disconnect frees."""

import json
import time

import httpx
import pytest

from tests.gateway_fixtures import REQUEST_TIMEOUT_S, Gateway, shared_gateway, start_gateway

HELLO = [{"role": "user", "content": "Tell me about the swarm."}]


@pytest.fixture(scope="module")
def gw() -> Gateway:
    return shared_gateway()


def _events(raw: bytes) -> list[str]:
    """``data:`` payloads of a raw SSE body, asserting the framing on the way."""
    text = raw.decode()
    assert text.endswith("\n\n"), "every event ends with a blank line"
    payloads = []
    for event in text.split("\n\n")[:-1]:
        lines = event.split("\n")
        if all(line.startswith(":") for line in lines):
            continue  # keep-alive comment
        assert len(lines) == 1 and lines[0].startswith("data: "), event
        payloads.append(lines[0][len("data: ") :])
    return payloads


def test_chat_stream_framing(gw):
    body = {
        "model": gw.model,
        "messages": HELLO,
        "max_tokens": 8,
        "temperature": 0,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with gw.http() as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers.get("x-request-id")
    payloads = _events(r.content)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    # a role chunk per choice comes first
    assert [c["choices"] for c in chunks[:2]] == [
        [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None, "index": i, "logprobs": None}]
        for i in (0, 1)
    ]
    usage = chunks[-1]
    assert usage["choices"] == []
    assert (
        usage["usage"]["total_tokens"]
        == usage["usage"]["prompt_tokens"] + usage["usage"]["completion_tokens"]
    )
    finishes = [ch for c in chunks[:-1] for ch in c["choices"] if ch["finish_reason"] is not None]
    assert sorted(ch["index"] for ch in finishes) == [0, 1]
    assert all(ch["delta"] == {} for ch in finishes)
    assert all(c["usage"] is None for c in chunks[:-1])
    # nothing of a choice comes after its finish chunk
    for i in (0, 1):
        positions = [k for k, c in enumerate(chunks) for ch in c["choices"] if ch["index"] == i]
        finish_at = next(
            k for k, c in enumerate(chunks) for ch in c["choices"] if ch["index"] == i and ch["finish_reason"]
        )
        assert positions[-1] == finish_at


def test_completion_stream_framing_without_usage(gw):
    body = {"model": gw.model, "prompt": "The swarm", "max_tokens": 5, "temperature": 0, "stream": True}
    with gw.http() as http:
        r = http.post("/v1/completions", json=body)
    payloads = _events(r.content)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks].count(None) == len(chunks) - 1
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_an_error_after_the_200_is_an_error_frame_then_done(gw):
    body = {"model": gw.model, "messages": HELLO, "max_tokens": 20, "temperature": 0, "stream": True}
    with gw.backend.tweaked(fail_at_step=4), gw.http() as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        payloads = _events(r.content)
        assert payloads[-1] == "[DONE]"
        err = json.loads(payloads[-2])
        assert set(err) == {"error"}
        assert err["error"]["type"] == "server_error"
        assert "choices" in json.loads(payloads[0])
        # the same failure without streaming is a 500 in the envelope
        r = http.post("/v1/chat/completions", json={**body, "stream": False})
        assert r.status_code == 500
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert gw.backend.wait_all_closed()


def test_client_disconnect_mid_stream_closes_the_sessions(gw):
    backend = gw.backend
    body = {
        "model": gw.model,
        "messages": HELLO,
        "max_tokens": 400,
        "n": 2,
        "stream": True,
        "temperature": 0,
        "logit_bias": {"2": -100, "0": -100},
    }  # no EOS: it would run all 400 steps
    with backend.tweaked(step_delay_s=0.02), gw.http() as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    seen += 1
                if seen >= 4:
                    break
        # leaving the block closed the connection mid-stream
        assert backend.wait_all_closed(timeout=10), f"{backend.open_sessions} sessions still open"
        steps = backend.steps
        time.sleep(0.2)
        assert backend.steps == steps, "generation went on after the disconnect"
        assert steps < 2 * 400
        assert backend.steps_after_close == 0


def test_client_disconnect_without_streaming_cancels_generation(gw):
    backend = gw.backend
    body = {
        "model": gw.model,
        "messages": HELLO,
        "max_tokens": 400,
        "temperature": 0,
        "logit_bias": {"2": -100, "0": -100},
    }
    with backend.tweaked(step_delay_s=0.02):
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=gw.url, timeout=0.5) as http:
            http.post("/v1/chat/completions", json=body)
        assert backend.wait_all_closed(timeout=10)
        assert backend.steps < 400
        assert backend.steps_after_close == 0
    with gw.http() as http:  # and the server is fine
        assert http.post("/v1/chat/completions", json={**body, "max_tokens": 2}).status_code == 200


def test_request_timeout(gw):
    slow = start_gateway(gw.backend, request_timeout_s=0.5)
    body = {"model": gw.model, "messages": HELLO, "max_tokens": 400, "logit_bias": {"2": -100, "0": -100}}
    try:
        with (
            gw.backend.tweaked(step_delay_s=0.02),
            httpx.Client(base_url=slow.url, timeout=REQUEST_TIMEOUT_S) as http,
        ):
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 504
            assert r.json()["error"]["code"] == "timeout"
            r = http.post("/v1/chat/completions", json={**body, "stream": True})
            payloads = _events(r.content)
            assert payloads[-1] == "[DONE]"
            assert json.loads(payloads[-2])["error"]["code"] == "timeout"
        assert gw.backend.wait_all_closed()
    finally:
        slow.server.stop()
