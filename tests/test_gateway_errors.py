"""Bad input and failing backends: the right status, OpenAI's envelope, and a server that keeps serving."""

import httpx
import openai
import pytest

from tests.gateway_fixtures import (
    BrokenStateBackend,
    Gateway,
    NoRouteBackend,
    assert_greedy,
    chat_prompt_ids,
    shared_gateway,
    temporary_gateway,
    tiny_tokenizer,
)

HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gw() -> Gateway:
    return shared_gateway()


@pytest.fixture(scope="module")
def client(gw):
    return gw.client()


def _envelope(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert response.headers.get("x-request-id")
    return body["error"]


def _still_serving(gw: Gateway) -> None:
    """After a failure the gateway still answers, and answers right: the greedy reply of 🤗 transformers."""
    r = gw.client().chat.completions.create(model=gw.model, messages=HELLO, max_tokens=2, temperature=0)
    assert_greedy(r, chat_prompt_ids(HELLO), 2)


def test_stop_with_more_than_4_entries_says_so(gw):
    with gw.http() as http:
        r = http.post("/v1/chat/completions", json={"model": gw.model, "messages": HELLO, "stop": list("abcde")})
    err = _envelope(r)
    assert r.status_code == 400 and err["param"] == "stop"
    assert "at most 4 items" in err["message"] and "not 5" in err["message"]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"messages": HELLO, "max_tokens": "10"}, "max_tokens", None),
        ({"messages": HELLO, "max_tokens": 1.5}, "max_tokens", None),
        ({"messages": HELLO, "max_tokens": -1}, "max_tokens", None),
        ({"messages": HELLO, "max_tokens": 0}, "max_tokens", None),
        ({"messages": HELLO, "max_tokens": 10**9}, "messages", "context_length_exceeded"),
        ({"messages": HELLO, "max_completion_tokens": 10**6}, "messages", "context_length_exceeded"),
        ({"messages": HELLO, "temperature": "warm"}, "temperature", None),
        ({"messages": HELLO, "n": "2"}, "n", None),
        ({"messages": HELLO, "n": 1000}, "n", None),
        ({"messages": []}, "messages", None),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", None),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", None),
        ({"messages": [{"role": "user"}]}, "messages[0].content", None),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
            None,
        ),
        (
            {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "maybe"},
            "tool_choice",
            None,
        ),
        ({"messages": HELLO, "functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        (  # a schema the grammar engine cannot compile
            {
                "messages": HELLO,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
            },
            "response_format",
            None,
        ),
        ({"messages": HELLO, "top_logprobs": 2}, "top_logprobs", None),
        ({"messages": HELLO, "stream_options": {"include_usage": True}}, "stream_options", None),
        ({"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop", None),
        ({"messages": HELLO, "logit_bias": {"abc": 1}}, "logit_bias", None),
        ({"messages": HELLO, "repetition_penalty": 5e-324}, "repetition_penalty", None),  # would make NaNs
    ],
)
def test_bad_chat_requests_are_400_naming_the_param(gw, body, param, code):
    body = {"model": gw.model, **body}
    with gw.http() as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = _envelope(r)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert err["code"] == code


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "echo": True, "stream": True}, "echo"),
        ({"prompt": "x", "logprobs": 6}, "logprobs"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt[1]"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"prompt": "x", "max_tokens": 10**9}, "prompt"),
    ],
)
def test_bad_completion_requests_are_400_naming_the_param(gw, body, param):
    with gw.http() as http:
        r = http.post("/v1/completions", json={"model": gw.model, **body})
    assert r.status_code == 400, r.text
    assert _envelope(r)["param"] == param


def test_malformed_json_wrong_shapes_and_routes(gw):
    with gw.http() as http:
        for raw in (b"{not json", b"", b"[]", b"null"):
            r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400
            assert _envelope(r)["type"] == "invalid_request_error"
        r = http.get("/v1/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        _envelope(r)
        r = http.get("/v1/nothing-here")
        assert r.status_code == 404
        _envelope(r)
    _still_serving(gw)


@pytest.mark.parametrize(
    ("path", "raw", "param", "words"),
    [
        ("/v1/chat/completions", '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", None, "nested too deeply"),
        ("/v1/completions", '{"prompt": "a", "max_tokens": ' + "9" * 5000 + "}", None, "number we cannot read"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content",
         "lone UTF-16 surrogate"),
        ("/v1/completions", '{"prompt": ["ok", "\\udc00"]}', "prompt.1", "lone UTF-16 surrogate"),
        ("/v1/responses", '{"input": "\\udbff!"}', "input", "lone UTF-16 surrogate"),
    ],
)  # fmt: skip
def test_bodies_python_cannot_hold_are_400(gw, path, raw, param, words):
    """Deep nesting (RecursionError), a 5000-digit integer (ValueError) and a lone surrogate (the tokenizer's
    TypeError) were 500s; each is a 400 saying what is wrong."""
    body = raw.replace("{", f'{{"model": "{gw.model}", ', 1)
    with gw.http() as http:
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = _envelope(r)
    assert words in err["message"] and err["param"] == param, err
    _still_serving(gw)


def test_a_surrogate_pair_is_text_not_an_error(gw):
    raw = f'{{"model": "{gw.model}", "max_tokens": 1, "messages": [{{"role": "user", "content": "\\ud83d\\ude00"}}]}}'
    with gw.http() as http:
        r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_a_vanishing_temperature_samples_the_argmax(gw, client):
    """temperature=1e-39 overflowed logits / temperature to inf (torch.multinomial: 500); it is greedy."""
    for temperature in (1e-39, 5e-324):
        r = client.chat.completions.create(model=gw.model, messages=HELLO, max_tokens=4, temperature=temperature)
        assert_greedy(r, chat_prompt_ids(HELLO), 4)


def test_context_overflow_message_names_limit_and_total(gw, client):
    limit = gw.backend.max_context
    long_prompt = "swarm " * limit
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=gw.model, messages=[{"role": "user", "content": long_prompt}], max_tokens=10
        )
    err = info.value
    assert err.status_code == 400
    assert err.code == "context_length_exceeded"
    assert f"maximum context length is {limit} tokens" in err.message
    assert "in the messages, 10 in the completion" in err.message
    with pytest.raises(openai.BadRequestError) as info:  # no max_tokens: the prompt alone is too long
        client.completions.create(model=gw.model, prompt=long_prompt)
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "prompt"
    _still_serving(gw)


def test_sdk_exceptions(gw, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other/model")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=gw.model, messages=[])
    assert info.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=gw.model, messages=HELLO, max_tokens=-5)
    assert info.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=gw.model, messages=HELLO, stream=True, max_tokens=10**7)
    assert info.value.code == "context_length_exceeded"  # before the stream starts
    _still_serving(gw)
    assert gw.backend.wait_all_closed()


def test_request_id_is_echoed_or_made(gw):
    with gw.http() as http:
        r = http.get("/v1/models", headers={"x-request-id": "abc-123"})
        assert r.headers["x-request-id"] == "abc-123"
        made = http.get("/v1/models").headers["x-request-id"]
        assert len(made) >= 16
        r = http.post("/v1/chat/completions", content=b"{", headers={"x-request-id": "err-1"})
        assert r.headers["x-request-id"] == "err-1"


def test_cors_preflight(gw):
    with gw.http() as http:
        r = http.options(
            "/v1/chat/completions",
            headers={"origin": "http://ui.example", "access-control-request-method": "POST"},
        )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] in ("*", "http://ui.example")


def test_missing_blocks_are_503_with_retry_after():
    with temporary_gateway(lambda: NoRouteBackend(tiny_tokenizer()), retry_after_s=3) as gw:
        with gw.http() as http:
            health = http.get("/health")
            assert health.status_code == 503
            assert health.json()["missing_blocks"] == [2, 3]
            for stream in (False, True):
                r = http.post(
                    "/v1/chat/completions", json={"model": gw.model, "messages": HELLO, "stream": stream}
                )
                assert r.status_code == 503
                assert r.headers["retry-after"] == "3"
                err = _envelope(r)
                assert "2-3" in err["message"]
                assert err["code"] == "no_route"
        with pytest.raises(openai.InternalServerError) as info:
            gw.client().completions.create(model=gw.model, prompt="x")
        assert info.value.status_code == 503


def test_unexpected_errors_are_500_in_the_envelope():
    with temporary_gateway(lambda: BrokenStateBackend(tiny_tokenizer())) as gw, gw.http() as http:
        r = http.get("/v1/swarm", headers={"x-request-id": "boom-1"})
        assert r.status_code == 500
        err = _envelope(r)
        assert err["type"] == "server_error"
        assert "a bug" not in err["message"]
        assert r.headers["x-request-id"] == "boom-1"
        assert http.get("/health").status_code == 503
