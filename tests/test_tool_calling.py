"""Tool calling with the official OpenAI SDK: the in-process gateway over a tiny random Llama (its chat template
is Qwen-style Hermes tool calling), Open WebUI's default request, and (``slow``) a real 2-worker swarm with a
follow-up turn that sends the tool's result and reuses the servers' cache.

The model is random: every call that parses against its schema here is the grammar's work.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway_fixtures import Gateway, chat_prompt_ids, shared_gateway

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city for the next days.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "metric": {"type": "boolean"},
            },
            "required": ["city", "days", "metric"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now in a time zone.",
        "parameters": {
            "type": "object",
            # ASCII only, so a call's length in tokens is bounded (a random model's unicode costs bytes)
            "properties": {"zone": {"type": "string", "pattern": "^[A-Za-z_/]{1,12}$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
#: enough for MAX_PARALLEL_CALLS (8) calls of these tools, every value bounded (the longest call is 66 tokens)
MAX_TOKENS = 600
#: what Open WebUI 0.12 sent by default, captured against this gateway (request, and our answer then: a 400)
OPEN_WEBUI = Path(__file__).parent / "data" / "open-webui-0.12-default-chat-request.json"


def assert_call_valid(name: str, arguments: str) -> dict:
    """``arguments`` is a JSON instance of the ``name`` tool's parameters."""
    tool = {t["function"]["name"]: t for t in TOOLS}[name]
    schema = tool["function"]["parameters"]
    value = json.loads(arguments)
    assert isinstance(value, dict) and set(value) == set(schema["required"])
    if name == "get_weather":
        assert value["city"] in ("Paris", "Oslo", "Lima") and 1 <= value["days"] <= 14
        assert isinstance(value["metric"], bool)
    else:
        assert isinstance(value["zone"], str) and re.fullmatch(r"[A-Za-z_/]{1,12}", value["zone"])
    return value


def stream_calls(stream: Any) -> tuple[str, list[tuple[str, str, str]], str | None]:
    """A streamed chat's content, calls ``(id, name, arguments)`` put together as clients do, and finish
    reason; checks OpenAI's delta shape on the way."""
    content, finish = "", None
    calls: dict[int, list[str]] = {}
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:  # a call's first delta: id, type, name
                assert d.id and d.type == "function" and d.function.name
                calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
            else:  # then argument pieces only
                assert d.id is None and d.function.name is None
                calls[d.index][2] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish  # type: ignore[misc]


@pytest.fixture(scope="module")
def gw() -> Gateway:
    return shared_gateway()


@pytest.fixture(scope="module")
def client(gw: Gateway) -> openai.OpenAI:
    return gw.client()


def test_required_calls_validate_for_10_seeds_at_temperature_1(gw: Gateway, client: openai.OpenAI) -> None:
    for seed in range(10):
        r = client.chat.completions.create(
            model=gw.model, messages=ASK, tools=TOOLS, tool_choice="required", seed=seed, temperature=1.0,
            max_tokens=MAX_TOKENS,
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            assert_call_valid(call.function.name, call.function.arguments)


def test_named_call_streamed_equals_non_streamed(gw: Gateway, client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    kw: dict[str, Any] = dict(
        model=gw.model, messages=ASK, tools=TOOLS, tool_choice=named, parallel_tool_calls=False,
        seed=7, temperature=1.0, max_tokens=MAX_TOKENS,
    )  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    call = whole.message.tool_calls[0]
    assert call.function.name == "get_time"
    assert_call_valid("get_time", call.function.arguments)
    content, calls, finish = stream_calls(client.chat.completions.create(stream=True, **kw))
    assert (content, finish) == ("", "tool_calls")
    assert [(name, args) for _, name, args in calls] == [("get_time", call.function.arguments)]


def test_parallel_calls_with_n_2(gw: Gateway, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=gw.model, messages=ASK, tools=TOOLS, tool_choice="required", n=2, seed=11, temperature=1.0,
        max_tokens=MAX_TOKENS,
    )  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        ids = [c.id for c in choice.message.tool_calls]
        assert len(set(ids)) == len(ids)
        for c in choice.message.tool_calls:
            assert_call_valid(c.function.name, c.function.arguments)


def test_tool_choice_none_answers_text_without_the_tools_in_the_prompt(gw: Gateway, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=gw.model, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8
    )
    plain = client.chat.completions.create(model=gw.model, messages=ASK, temperature=0, max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens == len(chat_prompt_ids(ASK))


def test_auto_renders_the_tools_through_the_chat_template(gw: Gateway, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=gw.model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=8)
    from tests.gateway_fixtures import tiny_tokenizer

    rendered = tiny_tokenizer().apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(tiny_tokenizer()(rendered, add_special_tokens=False)["input_ids"])
    assert r.usage.prompt_tokens > len(chat_prompt_ids(ASK)) + 50


def open_webui_request() -> dict:
    """What Open WebUI 0.12 sends by default: 36 tools, no ``tool_choice``, streaming."""
    body = json.loads(OPEN_WEBUI.read_text())["request_body"]
    assert len(body["tools"]) == 36 and "tool_choice" not in body and body["stream"] is True
    return body


def stream_open_webui_style(gw: Gateway, body: dict) -> None:
    """POST ``body`` as Open WebUI does (raw SSE): a 200 stream of text or calls, one finish, ``[DONE]``."""
    with gw.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks)
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish in (["length"], ["stop"], ["tool_calls"])
    said = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    calls = [d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert said or calls


def test_open_webui_shaped_request_streams_200(gw: Gateway) -> None:
    """Open WebUI's default request with its first 4 tools: all 36 are ~14k tokens of this tiny tokenizer,
    past its 2k context (a 400 saying so); the exact request runs on SmolLM2 in test_open_webui.py."""
    body = open_webui_request()
    stream_open_webui_style(gw, {**body, "tools": body["tools"][:4], "model": gw.model, "max_tokens": 16})
    with gw.http() as http:
        r = http.post("/v1/chat/completions", json={**body, "model": gw.model})
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "context_length_exceeded"
        # the user never wrote the tools: the 400 says they are what does not fit
        alone = f"The {len(body['tools'])} tool definitions alone are longer than that."
        assert error["message"].endswith(alone), error
        long_chat = [{"role": "user", "content": "tell me more " * 700}]
        shorter = {**body, "model": gw.model, "messages": long_chat, "tools": body["tools"][:4]}
        r = http.post("/v1/chat/completions", json=shorter)
        error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded", error
    share = re.search(r" (\d+) of the prompt's tokens are the 4 tool definitions sent with it", error["message"])
    assert share and 100 < int(share[1]) < 2048, error["message"]


def test_assistant_calls_and_tool_results_in_later_turns(gw: Gateway, client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=gw.model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        seed=1, temperature=1.0, max_tokens=MAX_TOKENS,
    ).choices[0].message  # fmt: skip
    call = first.tool_calls[0]
    follow = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(model=gw.model, messages=follow, tools=TOOLS, temperature=0, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    from tests.gateway_fixtures import tiny_tokenizer

    tok = tiny_tokenizer()
    converted = [*ASK, {**follow[1], "tool_calls": [{**call.model_dump(), "function": {
        "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]}, follow[2]]  # fmt: skip
    rendered = tok.apply_chat_template(converted, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in rendered
    assert r.usage.prompt_tokens == len(tok(rendered, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize(
    "patch,param",
    [
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(gw: Gateway, patch: dict, param: str) -> None:
    body = {"model": gw.model, "messages": ASK, "max_tokens": 4, **patch}
    with gw.http() as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ------------------------------------------------------------------------------------------- over a swarm


@pytest.fixture(scope="module")
def swarm_gw(calm_swarm_gateway: Gateway) -> Gateway:
    return calm_swarm_gateway


@pytest.mark.slow
def test_tool_calls_and_follow_up_over_a_two_worker_swarm(swarm_gw: Gateway) -> None:
    client = swarm_gw.client()
    kw: dict[str, Any] = dict(model=swarm_gw.model, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=1.0)
    for seed in range(3):  # required, streamed and not
        r = client.chat.completions.create(messages=ASK, tool_choice="required", seed=seed, **kw)
        assert r.choices[0].finish_reason == "tool_calls"
        for c in r.choices[0].message.tool_calls:
            assert_call_valid(c.function.name, c.function.arguments)
    named = {"type": "function", "function": {"name": "get_weather"}}
    _, calls, finish = stream_calls(
        client.chat.completions.create(messages=ASK, tool_choice=named, seed=5, stream=True, **kw)
    )
    assert finish == "tool_calls" and calls and all(name == "get_weather" for _, name, _ in calls)
    for _, name, args in calls:
        assert_call_valid(name, args)
    none = client.chat.completions.create(messages=ASK, tool_choice="none", **{**kw, "max_tokens": 6})
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content

    # a conversation: the model calls a tool, the client answers with its result, the model goes on
    session = {"X-Session-Id": "tools-follow-up"}
    first = (
        client.chat.completions.create(
            messages=ASK, tool_choice="required", parallel_tool_calls=False, seed=9, extra_headers=session, **kw
        )
        .choices[0]
        .message
    )
    call = first.tool_calls[0]
    follow = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"result": "sunny"}'},
    ]
    second = client.chat.completions.create(messages=follow, seed=9, extra_headers=session, **{**kw, "max_tokens": 8})
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the servers still hold the first turn (system + tools + question, and the call the model wrote)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0, second.usage
    assert cached >= len(chat_prompt_ids(ASK))
    with httpx.Client(base_url=swarm_gw.url) as http:
        assert http.get("/health").status_code == 200
