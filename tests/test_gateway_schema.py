"""Request parsing, the error envelope and settings, without a server."""

import json
import logging

import pytest

from gateway.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    ServiceUnavailableError,
    param_from_loc,
    to_gateway_error,
)
from gateway.schema.base import parse_request
from gateway.schema.replies import ChatCompletionChunk, ChoiceDelta, ChunkChoice
from gateway.schema.requests import ChatCompletionRequest
from gateway.settings import GatewaySettings
from swarm_client.errors import NoRouteError, SessionLost


def _chat(**body) -> bytes:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return json.dumps(body).encode()


def _param_of(body: bytes) -> str | None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(ChatCompletionRequest, body)
    return info.value.param


def test_a_valid_request_parses_with_content_parts_and_extras():
    req = parse_request(
        ChatCompletionRequest,
        _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}], top_k=5, stop="x"),
    )
    assert req.top_k == 5
    assert req.messages[0].content[0].text == "a"


def test_unknown_fields_are_accepted_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="gateway.schema.requests"):
        req = parse_request(ChatCompletionRequest, _chat(brand_new_option=1))
    assert req.model_extra == {"brand_new_option": 1}
    assert "brand_new_option" in caplog.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_chat(max_tokens="5"), "max_tokens"),
        (_chat(max_tokens=2.5), "max_tokens"),
        (_chat(max_tokens=0), "max_tokens"),
        (_chat(max_tokens=-3), "max_tokens"),
        (_chat(n=0), "n"),
        (_chat(temperature="hot"), "temperature"),
        (_chat(temperature=3), "temperature"),
        (_chat(top_logprobs=21), "top_logprobs"),
        (_chat(stop=["a", "b", "c", "d", "e"]), "stop"),
        (_chat(stream="yes"), "stream"),
        (_chat(messages="hi"), "messages"),
        (_chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
        (_chat(messages=[{"content": "x"}]), "messages[0].role"),
        (_chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
        (json.dumps({"model": "m"}).encode(), "messages"),
    ],
)
def test_bad_fields_name_their_param(body, param):
    assert _param_of(body) == param


def test_malformed_json_and_non_objects_are_400s():
    for body in (b"{bad", b"", b"\xff\xfe", b"[1, 2]", b'"text"'):
        with pytest.raises(InvalidRequestError) as info:
            parse_request(ChatCompletionRequest, body)
        assert info.value.status_code == 400
        assert set(info.value.payload()["error"]) == {"message", "type", "param", "code"}


def test_param_from_loc_drops_union_tags():
    assert (
        param_from_loc(("messages", 0, "content", "list[ChatCompletionContentPart]", 1, "text"))
        == "messages[0].content"
    )
    assert param_from_loc(("body", "max_tokens")) == "max_tokens"
    assert param_from_loc(("stop", "str")) == "stop"
    assert param_from_loc(()) is None


def test_error_envelopes():
    err = ContextLengthExceededError(
        max_context=100, prompt_tokens=60, completion_tokens=50, param="messages"
    )
    assert err.status_code == 400
    assert err.payload()["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 100 tokens" in err.message
    assert "110 tokens (60 in the messages, 50 in the completion)" in err.message
    assert ModelNotFoundError("x").status_code == 404

    no_route = to_gateway_error(NoRouteError("no chain", missing_blocks=[3, 4, 5, 9]), retry_after_s=7)
    assert isinstance(no_route, ServiceUnavailableError)
    assert no_route.status_code == 503
    assert no_route.headers() == {"Retry-After": "7"}
    assert "3-5, 9" in no_route.message
    assert to_gateway_error(SessionLost("gone")).status_code == 503

    bug = to_gateway_error(ZeroDivisionError("secret detail"))
    assert bug.status_code == 500
    assert "secret" not in bug.message  # internals stay in the log


def test_delta_and_chunk_serialization():
    assert ChoiceDelta().model_dump() == {}
    assert ChoiceDelta(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}
    chunk = ChatCompletionChunk(
        id="c", choices=[ChunkChoice(index=0, delta=ChoiceDelta(content="x"))], created=1, model="m"
    )
    data = json.loads(chunk.model_dump_json(exclude={"usage"}))
    assert data["choices"][0] == {
        "delta": {"content": "x"},
        "finish_reason": None,
        "index": 0,
        "logprobs": None,
    }
    assert "usage" not in data


def test_settings_defaults_and_env(monkeypatch):
    s = GatewaySettings()
    assert s.host == "127.0.0.1"
    assert s.cors_origins == ["*"]
    assert s.redis_url is None
    monkeypatch.setenv("SWARMSERVE_CORS_ORIGINS", "http://a.example, http://b.example")
    monkeypatch.setenv("SWARMSERVE_PORT", "9001")
    monkeypatch.setenv("SWARMSERVE_INITIAL_PEERS", '["/ip4/127.0.0.1/tcp/1/p2p/Qm"]')
    monkeypatch.setenv("SWARMSERVE_REDIS_URL", "redis://localhost:6379/0")
    s = GatewaySettings()
    assert s.cors_origins == ["http://a.example", "http://b.example"]
    assert s.port == 9001
    assert s.initial_peers == ["/ip4/127.0.0.1/tcp/1/p2p/Qm"]
    assert s.redis_url == "redis://localhost:6379/0"
    monkeypatch.setenv("SWARMSERVE_PORT", "70000")
    with pytest.raises(ValueError):
        GatewaySettings()


def test_fastapi_validation_errors_become_400_envelopes():
    """Routes that do use FastAPI's own validation (query/path params) never leak its raw 422 dump."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from gateway.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/items")
    async def items(limit: int) -> dict:
        return {"limit": limit}

    with TestClient(app) as client:
        r = client.get("/items", params={"limit": "many"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "limit"
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert client.get("/items").json()["error"]["param"] == "limit"
