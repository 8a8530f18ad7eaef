"""``POST /v1/responses`` (OpenAI's Responses API) through the official SDK against a real uvicorn gateway over
the tiny random Llama (LocalBackend), and (``slow``) over a real 2-worker swarm, where a follow-up naming
``previous_response_id`` resumes the servers' KV caches."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from gateway.responses.store import ResponsesStore
from tests.gateway_fixtures import (
    REQUEST_TIMEOUT_S,
    Gateway,
    chat_prompt_ids,
    shared_gateway,
    start_gateway,
)

QUESTION = "Tell me about the swarm."
FOLLOW_UP = "And what happens when a server leaves?"
#: a strict schema whose only instances are two short objects: the grammar ends the reply, "completed"
YES_NO = {
    "format": {
        "type": "json_schema",
        "name": "yes_no",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"a": {"type": "boolean"}},
            "required": ["a"],
            "additionalProperties": False,
        },
    }
}
STREAM_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_END = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def gw() -> Gateway:
    return shared_gateway()


@pytest.fixture(scope="module")
def client(gw: Gateway) -> openai.OpenAI:
    return gw.client()


def _chat_text(client: openai.OpenAI, gw: Gateway, messages: list[dict], max_tokens: int) -> tuple[str, str]:
    r = client.chat.completions.create(model=gw.model, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content or "", r.choices[0].finish_reason


def test_string_input_is_the_chat_answer(gw: Gateway, client: openai.OpenAI) -> None:
    r = client.responses.create(model=gw.model, input=QUESTION, max_output_tokens=10, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [p.type for p in item.content] == ["output_text"] and item.content[0].annotations == []
    text, finish = _chat_text(client, gw, [{"role": "user", "content": QUESTION}], 10)
    assert r.output_text == text
    assert r.status == ("incomplete" if finish == "length" else "completed")
    prompt = chat_prompt_ids([{"role": "user", "content": QUESTION}])
    u = r.usage
    assert (u.input_tokens, u.input_tokens_details.cached_tokens) == (len(prompt), 0)
    assert u.output_tokens_details.reasoning_tokens == 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert (r.max_output_tokens, r.temperature, r.tools, r.store, r.error) == (10, 0, [], True, None)
    assert gw.backend.wait_all_closed()


def test_messages_and_instructions(gw: Gateway, client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=gw.model,
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Answer in English."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Sure.", "annotations": []}]},
            {"role": "user", "content": [{"type": "input_text", "text": "more"}, {"type": "input_text", "text": "!"}]},
        ],
        max_output_tokens=6,
        temperature=0,
        metadata={"k": "v"},
    )
    rendered = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": "Tell me"},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": "more\n!"},
    ]
    assert r.output_text == _chat_text(client, gw, rendered, 6)[0]
    assert r.usage.input_tokens == len(chat_prompt_ids(rendered))
    assert (r.instructions, r.metadata) == ("Be brief.", {"k": "v"})


def test_max_output_tokens_makes_it_incomplete(gw: Gateway, client: openai.OpenAI) -> None:
    r = client.responses.create(model=gw.model, input=QUESTION, max_output_tokens=2, temperature=0)
    assert _chat_text(client, gw, [{"role": "user", "content": QUESTION}], 2)[1] == "length"  # the premise
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 2


def test_chat_only_knobs_sent_as_extra_fields_are_ignored_not_read(gw: Gateway) -> None:
    """``frequency_penalty`` and ``logit_bias`` are not Responses API fields: sent anyway (unvalidated),
    they are ignored and named in the ignored-fields log, never fed to the sampler."""
    body = {"model": gw.model, "input": QUESTION, "max_output_tokens": 3, "temperature": 0}
    with gw.http() as http:
        plain = http.post("/v1/responses", json=body)
        junk = http.post("/v1/responses", json={**body, "frequency_penalty": "junk", "logit_bias": {"x": "y"}})
    assert plain.status_code == junk.status_code == 200, junk.text
    text = [r.json()["output"][0]["content"][0]["text"] for r in (plain, junk)]
    assert text[0] == text[1]


def test_stream_events_and_text_equal_the_plain_response(gw: Gateway, client: openai.OpenAI) -> None:
    plain = client.responses.create(model=gw.model, input=QUESTION, max_output_tokens=12, temperature=0)
    events = list(
        client.responses.create(model=gw.model, input=QUESTION, max_output_tokens=12, temperature=0, stream=True)
    )
    types = [e.type for e in events]
    assert types[:4] == STREAM_ORDER and types[-4:-1] == STREAM_END
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert types[-1] == f"response.{plain.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == plain.output_text == events[-4].text
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(events[2].item.id, 0, 0)}
    final = events[-1].response
    assert final.output_text == plain.output_text and final.usage == plain.usage
    assert final.id == events[0].response.id != plain.id


def test_stream_helper_gets_the_final_response(gw: Gateway, client: openai.OpenAI) -> None:
    plain = client.responses.create(model=gw.model, input=QUESTION, max_output_tokens=16, temperature=0, text=YES_NO)
    assert plain.status == "completed" and json.loads(plain.output_text) in ({"a": True}, {"a": False})
    with client.responses.stream(
        model=gw.model, input=QUESTION, max_output_tokens=16, temperature=0, text=YES_NO
    ) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert final.output_text == plain.output_text and final.usage.output_tokens == plain.usage.output_tokens
    # cut short: OpenAI ends the stream with response.incomplete, which the helper's events carry too
    with client.responses.stream(model=gw.model, input=QUESTION, max_output_tokens=3, temperature=0) as stream:
        last = list(stream)[-1]
    assert last.type == "response.incomplete" and last.response.usage.output_tokens == 3


def test_an_error_after_the_200_is_a_failed_event(gw: Gateway, client: openai.OpenAI) -> None:
    with gw.backend.tweaked(fail_at_step=3):
        events = list(client.responses.create(model=gw.model, input=QUESTION, max_output_tokens=8, stream=True))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.message and events[-2].message == failed.error.message
    with pytest.raises(openai.NotFoundError):  # not kept: nothing to continue
        client.responses.retrieve(failed.id)
    assert gw.backend.wait_all_closed()


def test_sse_frames_name_their_event(gw: Gateway) -> None:
    with gw.http() as http:
        body = http.post("/v1/responses", json={"input": "hi", "stream": True, "max_output_tokens": 2}).text
    frames = [f for f in body.split("\n\n") if f.strip()]
    for frame in frames:
        event, data = frame.split("\n", 1)
        assert event.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]


def test_previous_response_id_continues_the_conversation(gw: Gateway, client: openai.OpenAI) -> None:
    first = client.responses.create(model=gw.model, input=QUESTION, max_output_tokens=6, temperature=0)
    second = client.responses.create(
        model=gw.model, input=FOLLOW_UP, previous_response_id=first.id, max_output_tokens=6, temperature=0
    )
    whole = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": FOLLOW_UP},
    ]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == len(chat_prompt_ids(whole))
    assert second.output_text == _chat_text(client, gw, whole, 6)[0]
    # retrieve and delete
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=gw.model, input="x", previous_response_id=second.id, max_output_tokens=2)


def test_store_false_is_not_kept(gw: Gateway, client: openai.OpenAI) -> None:
    r = client.responses.create(model=gw.model, input=QUESTION, max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=gw.model, input="x", previous_response_id=r.id, max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id"


@pytest.fixture(scope="module")
def keyed(gw: Gateway) -> Iterator[Gateway]:
    """A second app over the shared backend, with API keys."""
    keyed = start_gateway(gw.backend, api_keys=["key-alice", "key-bob"])
    yield keyed
    keyed.server.stop()


def test_another_key_cannot_see_or_continue_a_response(keyed: Gateway) -> None:
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=keyed.server.base_url, api_key=key, timeout=REQUEST_TIMEOUT_S, max_retries=0)

    alice, bob = client("key-alice"), client("key-bob")
    r = alice.responses.create(model=keyed.model, input=QUESTION, max_output_tokens=3)
    assert alice.responses.retrieve(r.id).id == r.id
    for attempt in (
        lambda: bob.responses.retrieve(r.id),
        lambda: bob.responses.create(model=keyed.model, input="x", previous_response_id=r.id, max_output_tokens=2),
        lambda: bob.responses.delete(r.id),
    ):
        with pytest.raises(openai.NotFoundError) as info:
            attempt()
        assert "not found" in info.value.message
    assert alice.responses.create(model=keyed.model, input="x", previous_response_id=r.id, max_output_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client("key-mallory").responses.retrieve(r.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0]"),
        ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0]"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0]"),
        ({"tools": [{"type": "computer_use_preview", "display_width": 1, "display_height": 1}]}, "tools[0]"),
        ({"tools": [{"type": "custom", "name": "f"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"include": ["file_search_call.results"]}, "include[0]"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
        ({"input": []}, "input"),
        ({"input": None}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"truncation": "sometimes"}, "truncation"),
    ],
)
def test_unsupported_parts_are_400s_naming_them(gw: Gateway, body: dict, param: str) -> None:
    with gw.http() as http:
        r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_accepted_no_op_parameters(gw: Gateway, client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=gw.model,
        input=QUESTION,
        max_output_tokens=2,
        tools=[],
        tool_choice="auto",
        parallel_tool_calls=False,
        truncation="disabled",
        reasoning={"effort": None},
        text={"format": {"type": "text"}},
        user="someone",
        include=[],
    )
    assert (r.parallel_tool_calls, r.tool_choice, r.user, r.truncation) == (False, "auto", "someone", "disabled")


def test_truncation_auto_drops_the_oldest_turns(gw: Gateway, client: openai.OpenAI) -> None:
    long_turns = [{"role": "user", "content": "word " * 1000}, {"role": "assistant", "content": "ok"}]
    body = {"input": [*long_turns * 3, {"role": "user", "content": QUESTION}], "max_output_tokens": 2}
    with gw.http() as http:
        assert http.post("/v1/responses", json=body).json()["error"]["code"] == "context_length_exceeded"
        r = http.post("/v1/responses", json={**body, "truncation": "auto"})
    assert r.status_code == 200 and r.json()["usage"]["input_tokens"] <= gw.backend.max_context


def test_metrics_and_access_log_see_the_route(gw: Gateway, client: openai.OpenAI, caplog) -> None:
    with caplog.at_level("INFO", logger="gateway.access"):
        client.responses.create(model=gw.model, input=QUESTION, max_output_tokens=2)
    assert any('"POST /v1/responses" 200' in m and "completion_tokens=2" in m for m in caplog.messages)
    with gw.http() as http:
        assert 'route="/v1/responses"' in http.get("/metrics").text


def test_store_evicts_through_the_api(gw: Gateway, client: openai.OpenAI) -> None:
    app_state = gw.server.app.state
    saved = getattr(app_state, "responses_store", None)
    app_state.responses_store = ResponsesStore(max_entries=2)
    try:
        ids = [client.responses.create(model=gw.model, input=QUESTION, max_output_tokens=1).id for _ in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    finally:
        app_state.responses_store = saved


# ------------------------------------------------------------------------------------------ a real swarm


@pytest.fixture(scope="module")
def swarm_gateways(tiny_llama: str) -> Iterator[dict[str, Gateway]]:
    from gateway.backends.swarm import SwarmBackend
    from tests.swarm_fixtures import Swarm

    s = Swarm(tiny_llama)
    backend = None
    gws: dict[str, Gateway] = {}
    try:
        fast = ("--throughput", "1000")  # skips the startup benchmark; deterministic routing
        procs = [s.add_worker(*fast, blocks=span, wait=False) for span in ("0:2", "2:4")]
        for proc in procs:
            proc.wait_for("swarmserve worker ready:")
        backend = SwarmBackend(tiny_llama, [s.initial_peers], update_period=1.0, pipeline_groups="auto")
        gws = {"gw": start_gateway(backend), "ref": start_gateway(backend, affinity=False)}
        yield gws
    finally:
        for g in gws.values():
            g.server.stop()
        if backend is not None:
            backend.close()
        s.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_follow_up_over_a_swarm_reuses_the_kv_cache(swarm_gateways: dict[str, Gateway], tiny_llama: str) -> None:
    gw, ref = swarm_gateways["gw"], swarm_gateways["ref"]
    client = gw.client()
    first = client.responses.create(
        model=gw.model, instructions="You answer questions.", input=QUESTION, max_output_tokens=8, temperature=0
    )
    assert first.usage.input_tokens_details.cached_tokens == 0
    events = list(
        client.responses.create(
            model=gw.model,
            instructions="You answer questions.",
            input=QUESTION,
            max_output_tokens=8,
            temperature=0,
            stream=True,
        )
    )
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == first.output_text
    second = client.responses.create(
        model=gw.model,
        instructions="You answer questions.",
        input=FOLLOW_UP,
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    whole = [
        {"role": "system", "content": "You answer questions."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": FOLLOW_UP},
    ]
    assert second.usage.input_tokens == len(chat_prompt_ids(whole, tiny_llama))  # the first turn is in it
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert second.output_text == _chat_text(ref.client(), ref, whole, 8)[0]  # the same as without reuse
