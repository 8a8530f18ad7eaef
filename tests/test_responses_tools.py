"""Function tools on ``/v1/responses`` through the official SDK against the in-process gateway over the tiny
random Llama (Hermes tool calling): forced calls as ``function_call`` output items, streamed as OpenAI's
events, a tool's result sent back as a ``function_call_output`` (through ``previous_response_id`` or as
input items) answered with text, and the chat path's answer for the same conversation as the reference.

The model is random: every call that parses against its schema here is the grammar's work.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.gateway_fixtures import Gateway, shared_gateway
from tests.test_tool_calling import TOOLS, assert_call_valid

#: the same tools in the Responses API's flat shape
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ASK = "What is the weather in Paris?"
MAX_TOKENS = 600


@pytest.fixture(scope="module")
def gw() -> Gateway:
    return shared_gateway()


@pytest.fixture(scope="module")
def client(gw: Gateway) -> openai.OpenAI:
    return gw.client()


def _calls(response: Any) -> list[Any]:
    return [item for item in response.output if item.type == "function_call"]


def _create(client: openai.OpenAI, gw: Gateway, **kw: Any) -> Any:
    kw.setdefault("input", ASK)
    kw.setdefault("tools", RESPONSE_TOOLS)
    kw.setdefault("max_output_tokens", MAX_TOKENS)
    kw.setdefault("temperature", 0)
    return client.responses.create(model=gw.model, **kw)


def test_required_makes_function_call_items(gw: Gateway, client: openai.OpenAI) -> None:
    r = _create(client, gw, tool_choice="required")
    calls = _calls(r)
    assert r.status == "completed" and calls and len(calls) == len(r.output)  # only calls: no message item
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
        assert_call_valid(call.name, call.arguments)
    assert len({c.call_id for c in calls}) == len(calls)
    assert r.tool_choice == "required" and [t.name for t in r.tools] == ["get_weather", "get_time"]
    assert r.usage.output_tokens > 0 and r.output_text == ""
    assert client.responses.retrieve(r.id).output == r.output


def test_named_choice_calls_that_function_once(gw: Gateway, client: openai.OpenAI) -> None:
    r = _create(client, gw, tool_choice={"type": "function", "name": "get_time"}, parallel_tool_calls=False)
    (call,) = _calls(r)
    assert call.name == "get_time" and assert_call_valid("get_time", call.arguments)
    assert r.tool_choice.type == "function" and r.tool_choice.name == "get_time"


def test_named_call_streamed_equals_non_streamed(gw: Gateway, client: openai.OpenAI) -> None:
    choice = {"type": "function", "name": "get_weather"}
    plain = _create(client, gw, tool_choice=choice, parallel_tool_calls=False)
    events = list(_create(client, gw, tool_choice=choice, parallel_tool_calls=False, stream=True))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-4:] == [
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, done, item_done = events[2].item, events[-3], events[-2].item
    assert added.type == "function_call" and added.status == "in_progress" and added.arguments == ""
    assert (added.id, added.call_id, added.name) == (item_done.id, item_done.call_id, "get_weather")
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert {(e.item_id, e.output_index) for e in deltas} == {(added.id, 0)} == {(done.item_id, done.output_index)}
    assert "".join(e.delta for e in deltas) == done.arguments == item_done.arguments
    (call,) = _calls(plain)
    assert item_done.arguments == call.arguments and item_done.status == "completed"
    final = events[-1].response
    assert final.output == [item_done] and final.usage == plain.usage


def test_stream_helper_gets_the_calls(gw: Gateway, client: openai.OpenAI) -> None:
    plain = _create(client, gw, tool_choice="required", temperature=1.0, extra_body={"seed": 3})
    with client.responses.stream(
        model=gw.model,
        input=ASK,
        tools=RESPONSE_TOOLS,
        tool_choice="required",
        max_output_tokens=MAX_TOKENS,
        temperature=1.0,
        extra_body={"seed": 3},
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert events[-1].type == "response.completed"
    assert [(c.name, c.arguments) for c in _calls(final)] == [(c.name, c.arguments) for c in _calls(plain)]
    for call in _calls(final):  # strict tools: the helper parsed the arguments
        assert call.parsed_arguments == json.loads(call.arguments)


def test_function_call_output_follow_up_is_answered_with_text(gw: Gateway, client: openai.OpenAI) -> None:
    first = _create(client, gw, tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    (call,) = _calls(first)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    second = _create(client, gw, input=[result], previous_response_id=first.id, max_output_tokens=8)
    (message,) = second.output
    assert message.type == "message" and second.previous_response_id == first.id
    # the chat path answers the same conversation with the same text and prompt
    chat = client.chat.completions.create(
        model=gw.model,
        messages=[
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ]},
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature": 21}'},
        ],
        tools=TOOLS,
        max_tokens=8,
        temperature=0,
    )  # fmt: skip
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert (second.output_text or None, []) == (chat.choices[0].message.content, _calls(second))
    # the same turn sent whole, without stored state (as a stateless client does)
    whole = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result]
    stateless = _create(client, gw, input=whole, max_output_tokens=8, store=False)
    assert stateless.output_text == second.output_text and stateless.usage.input_tokens == chat.usage.prompt_tokens


def test_tool_choice_none_answers_text_without_the_tools(gw: Gateway, client: openai.OpenAI) -> None:
    with_none = _create(client, gw, tool_choice="none", max_output_tokens=8)
    without = client.responses.create(model=gw.model, input=ASK, max_output_tokens=8, temperature=0)
    assert [i.type for i in with_none.output] == ["message"]
    assert with_none.output_text == without.output_text and with_none.usage.input_tokens == without.usage.input_tokens


def test_auto_renders_the_tools_and_answers(gw: Gateway, client: openai.OpenAI) -> None:
    auto = _create(client, gw, max_output_tokens=8)
    without = client.responses.create(model=gw.model, input=ASK, max_output_tokens=8, temperature=0)
    assert auto.usage.input_tokens > without.usage.input_tokens  # the tools are in the prompt
    assert auto.output and all(i.type in ("message", "function_call") for i in auto.output)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "web_search"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0]", "file_search"),
        ({"tools": RESPONSE_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
        ({"tools": [*RESPONSE_TOOLS, RESPONSE_TOOLS[0]]}, "tools[2].name", "twice"),
        ({"tools": RESPONSE_TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
    ],
)
def test_bad_tools_are_400s_naming_them(gw: Gateway, client: openai.OpenAI, body: dict, param: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=gw.model, input=ASK, max_output_tokens=4, **body)
    assert info.value.body["param"] == param and words in info.value.message


def _plan(fmt_name: str = "hermes") -> Any:
    from gateway.responses.tools import plan_response_tools
    from gateway.tools.formats import TOOL_FORMATS

    return plan_response_tools(RESPONSE_TOOLS, "auto", None, TOOL_FORMATS[fmt_name])  # type: ignore[index]


def test_output_items_streamed_piece_by_piece_equal_the_whole() -> None:
    """Text, a call, more text: a message, a function_call, a second message — whether the reply comes a
    character at a time (events in OpenAI's order, indexes counting up) or all at once."""
    from gateway.responses.output import OutputItems

    reply = 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\nDone.'
    whole = OutputItems(_plan(), "msg_1")
    whole.start(), whole.feed(reply), whole.finish("completed")
    events: list[tuple[str, dict]] = []
    pieces = OutputItems(_plan(), "msg_1", emit=lambda t, **f: (t, f))
    events += pieces.start()
    for ch in reply:
        events += pieces.feed(ch)
    events += pieces.finish("completed")
    assert [i.type for i in whole.items] == ["message", "function_call", "message"]
    ids = {"id", "call_id"}  # new each time
    assert [i.model_dump(exclude=ids) for i in pieces.items] == [i.model_dump(exclude=ids) for i in whole.items]
    text, call, after = pieces.items
    assert (text.content[0].text, call.name, call.arguments, after.content[0].text) == (
        "Let me look.\n", "get_time", '{"zone": "UTC"}', "\nDone.",
    )  # fmt: skip
    added = [f["output_index"] for t, f in events if t == "response.output_item.added"]
    done = [f["item"]["id"] for t, f in events if t == "response.output_item.done"]
    assert added == [0, 1, 2] and done == [i.id for i in pieces.items]
    arguments = "".join(f["delta"] for t, f in events if t == "response.function_call_arguments.delta")
    assert arguments == call.arguments
    assert pieces.assistant_message() == {
        "role": "assistant",
        "content": "Let me look.\n\nDone.",
        "tool_calls": [{"id": call.call_id, "type": "function", "function": {"name": "get_time",
                                                                                "arguments": call.arguments}}],
    }  # fmt: skip


def test_output_items_cut_short_mark_the_open_call_incomplete() -> None:
    from gateway.responses.output import OutputItems

    items = OutputItems(_plan(), "msg_1")
    items.start(), items.feed('<tool_call>\n{"name": "get_time", "arguments": {"zone": "U'), items.finish("incomplete")
    (call,) = items.items
    assert (call.type, call.status, call.arguments) == ("function_call", "incomplete", '{"zone": "U')
    blank = OutputItems(_plan(), "msg_1")
    blank.start(), blank.feed(""), blank.finish("completed")
    assert [(i.type, i.id, i.content[0].text) for i in blank.items] == [("message", "msg_1", "")]


@pytest.fixture(scope="module")
def prompt_format(gw: Gateway) -> Any:
    """A second app over the shared backend whose tools are taught in the system prompt (``prompt``)."""
    from tests.gateway_fixtures import start_gateway

    other = start_gateway(gw.backend, tool_format="prompt")
    yield other
    other.server.stop()


def test_a_template_without_tools_gets_them_in_the_prompt(prompt_format: Gateway) -> None:
    client = prompt_format.client()
    first = _create(client, prompt_format, tool_choice="required", parallel_tool_calls=False)
    (call,) = _calls(first)
    assert_call_valid(call.name, call.arguments)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = _create(client, prompt_format, input=[result], previous_response_id=first.id, max_output_tokens=4)
    assert second.output and second.usage.input_tokens > first.usage.input_tokens


def test_an_error_inside_a_call_fails_the_response_with_the_call_so_far(gw: Gateway, client: openai.OpenAI) -> None:
    weather = {"type": "function", "name": "get_weather"}
    with gw.backend.tweaked(fail_at_step=25):  # after the name, before the end of the arguments
        events = list(_create(client, gw, tool_choice=weather, stream=True))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    (call,) = events[-1].response.output
    assert (call.type, call.status, call.name) == ("function_call", "incomplete", "get_weather")
    with pytest.raises(openai.NotFoundError):  # not kept
        client.responses.retrieve(events[-1].response.id)
    assert gw.backend.wait_all_closed()


def test_parallel_tool_calls_false_makes_one_call(gw: Gateway, client: openai.OpenAI) -> None:
    r = _create(client, gw, tool_choice="required", parallel_tool_calls=False, temperature=1.0, extra_body={"seed": 5})
    (call,) = _calls(r)
    assert r.parallel_tool_calls is False and assert_call_valid(call.name, call.arguments)


def test_input_items_become_chat_messages() -> None:
    """Calls join the assistant message before them; results become tool messages answering a known call."""
    from gateway.errors import InvalidRequestError
    from gateway.responses.input import called_ids, input_messages

    call = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": "{}"}
    items = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        call,
        {**call, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "noon"}]},
    ]
    messages = input_messages(items)
    assert messages[1] == {
        "role": "assistant",
        "content": "Looking.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    }
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "noon"}
    assert called_ids(messages) == {"call_1", "call_2"}
    later = [{"type": "function_call_output", "call_id": "call_2", "output": "noon"}]
    assert input_messages(later, called_ids(messages))[0]["tool_call_id"] == "call_2"
    with pytest.raises(InvalidRequestError) as info:
        input_messages(later)  # no such call in this conversation
    assert info.value.param == "input[0].call_id"
