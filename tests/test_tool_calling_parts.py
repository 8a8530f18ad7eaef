"""Tool calling's parts without a server: the per-family call parser (streamed in any pieces = parsed whole),
format detection from chat templates, the forcing grammars (llguidance accepts valid calls and refuses
anything else), and how chat messages with calls and results reach a template."""

from __future__ import annotations

import json
import random

import pytest

from gateway.api.chat_messages import chat_messages
from gateway.errors import InvalidRequestError
from gateway.schema.requests import ChatCompletionMessageParam, ChatCompletionRequest
from gateway.tools.formats import TOOL_FORMATS, detect_tool_format, tool_call_id
from gateway.tools.grammar import MAX_PARALLEL_CALLS, tool_call_grammar
from gateway.tools.parser import ToolCallDelta, ToolCallParser, parse_tool_calls
from gateway.tools.plan import plan_tools
from swarm_client.tiny_model import CHAT_TEMPLATE, build_tokenizer

HERMES, LLAMA, MISTRAL, PROMPT = (TOOL_FORMATS[n] for n in ("hermes", "llama3_json", "mistral", "prompt"))

#: (format, model output, expected content, expected [(name, arguments)])
CASES = [
    (
        HERMES,
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
        '</tool_call>\n<tool_call>\n{"arguments": {"q": "a } \\" ]"}, "name": "search"}\n</tool_call>',
        "Let me check.\n",
        [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("search", '{"q": "a } \\" ]"}')],
    ),
    (HERMES, "plain text with <tool_ and < tool_call > in it", "plain text with <tool_ and < tool_call > in it", []),
    (HERMES, '<tool_call>\n{"nom": 1}\n</tool_call> tail', '<tool_call>\n{"nom": 1}\n</tool_call> tail', []),
    (HERMES, '<tool_call>\n{"name": "f"}\n</tool_call>', None, [("f", "{}")]),
    (PROMPT, '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', None, [("f", '{"a": 1}')]),
    (
        LLAMA,
        ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
        None,
        [("f", '{"a": 1}'), ("g", "{}")],
    ),
    (LLAMA, '<|python_tag|>{"name": "f", "parameters": {"x": "a;b"}}', None, [("f", '{"x": "a;b"}')]),
    (LLAMA, 'Hello {"name": "f"}', 'Hello {"name": "f"}', []),
    (LLAMA, '{"not": "a call"}', '{"not": "a call"}', []),
    (
        MISTRAL,
        '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": [2]}}]',
        None,
        [("f", '{"a": 1}'), ("g", '{"b": [2]}')],
    ),
    (MISTRAL, "No [TOOL_CALL here", "No [TOOL_CALL here", []),
]


def _stream(parser: ToolCallParser, text: str, seed: int) -> list:
    rng = random.Random(seed)
    events, i = [], 0
    while i < len(text):
        k = rng.randint(1, 5)
        events += parser.feed(text[i : i + k])
        i += k
    return events + parser.finish()


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_parser_whole_and_streamed_in_any_pieces_agree(fmt, text, content, calls) -> None:
    whole = parse_tool_calls(text, fmt)
    assert whole.content == content
    assert [(c.name, c.arguments) for c in whole.calls] == calls
    for seed in range(5):
        parser = ToolCallParser(fmt)
        events = _stream(parser, text, seed)
        streamed_text = "".join(e for e in events if isinstance(e, str))
        assert streamed_text == (content or "")
        deltas = [e for e in events if isinstance(e, ToolCallDelta)]
        # OpenAI's shape: a call's id and name on its first delta only, then argument pieces
        for index in range(len(calls)):
            mine = [d for d in deltas if d.index == index]
            assert mine[0].id is not None and mine[0].name == calls[index][0]
            assert all(d.id is None and d.name is None for d in mine[1:])
            assert "".join(d.arguments for d in mine) == calls[index][1]
        assert [(c.name, c.arguments) for c in parser.calls] == calls


def test_arguments_stream_before_the_call_ends() -> None:
    parser = ToolCallParser(HERMES)
    events = parser.feed('<tool_call>\n{"name": "f", "arguments": {"text": "a long')
    assert [type(e) for e in events] == [ToolCallDelta, ToolCallDelta]
    assert events[0].name == "f" and events[1].arguments == '{"text": "a long'


def test_a_call_cut_short_keeps_what_it_has() -> None:
    reply = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"a": "tr', HERMES)
    assert reply.content is None and [(c.name, c.arguments) for c in reply.calls] == [("f", '{"a": "tr')]


def test_call_ids_openai_shape_and_mistral_nine_alnum() -> None:
    assert tool_call_id(HERMES).startswith("call_") and tool_call_id(HERMES) != tool_call_id(HERMES)
    assert tool_call_id(HERMES, "call_abc") == "call_abc"
    mapped = tool_call_id(MISTRAL, "call_abcdefghijklmnop")
    assert len(mapped) == 9 and mapped.isalnum() and mapped == tool_call_id(MISTRAL, "call_abcdefghijklmnop")
    assert tool_call_id(MISTRAL, "abc123XYZ") == "abc123XYZ"


def test_format_detection_from_chat_templates() -> None:
    assert detect_tool_format(CHAT_TEMPLATE).name == "hermes"
    assert detect_tool_format(None).name == "prompt"
    smollm2 = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']}}"
    assert detect_tool_format(smollm2).name == "prompt"
    assert detect_tool_format("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]").name == "mistral"
    llama = "{%- if tools %}<|start_header_id|>ipython<|end_header_id|>{{ '<|python_tag|>' }}{% endif %}"
    assert detect_tool_format(llama).name == "llama3_json"


# ------------------------------------------------------------------------------------------------ grammars

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "strict": True,
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}


def _accepts(tokenizer, lark: str, text: str) -> bool:
    import llguidance
    import llguidance.hf

    lt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    is_error, _ = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lt)
    assert not is_error
    matcher = llguidance.LLMatcher(lt, grammar)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.mark.parametrize(
    "fmt,good",
    [
        (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'),
        (PROMPT, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
        (LLAMA, '{"name": "get_weather", "parameters": {"city": "Paris", "days": 12}}'),
        (MISTRAL, '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]'),
    ],
)
def test_grammar_accepts_calls_in_the_format_and_nothing_else(tokenizer, fmt, good) -> None:
    one = tool_call_grammar([WEATHER, TIME], fmt, parallel=False)
    assert _accepts(tokenizer, one, good)
    assert not _accepts(
        tokenizer, one, good.replace('"Oslo"', '"Rome"').replace('"Paris"', '"Rome"').replace("{}", '{"x": 1}')
    )
    assert not _accepts(tokenizer, one, "Sure! " + good)  # text first: not a forced call
    assert not _accepts(tokenizer, one, good.replace(": ", ":"))  # compact JSON is not how templates write it
    sep = {"hermes": "\n", "prompt": "\n", "llama3_json": "; "}.get(fmt.name)
    if sep is not None:
        assert not _accepts(tokenizer, one, good + sep + good)  # one call when not parallel
        assert _accepts(tokenizer, tool_call_grammar([WEATHER, TIME], fmt, parallel=True), good + sep + good)


def test_named_grammar_allows_only_that_function(tokenizer) -> None:
    lark = tool_call_grammar([TIME], HERMES, parallel=True)
    assert _accepts(tokenizer, lark, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
    assert not _accepts(tokenizer, lark, weather)
    many = "\n".join(['<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'] * (MAX_PARALLEL_CALLS + 1))
    assert not _accepts(tokenizer, lark, many)


def test_mistral_opener_as_one_special_token() -> None:
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    opener = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    lark = tool_call_grammar([TIME], MISTRAL, parallel=False, opener_token=opener)
    assert f"<[{opener}]>" in lark
    assert _accepts(tok, lark, '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]')


# ------------------------------------------------------------------------------------------------ messages


def _messages(*raw: dict) -> list[ChatCompletionMessageParam]:
    return [ChatCompletionMessageParam.model_validate(m) for m in raw]


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
TURNS = (
    {"role": "user", "content": "time?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
)


def _plan(fmt):
    req = ChatCompletionRequest.model_validate(
        {"messages": list(TURNS), "tools": [{"type": "function", "function": TIME}]}
    )
    return plan_tools(req, fmt)


def test_native_template_gets_calls_as_objects_and_tool_messages() -> None:
    out = chat_messages(_messages(*TURNS), HERMES, _plan(HERMES))
    assert out[1]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": {"tz": "UTC"}}
    assert out[2] == {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}
    text = build_tokenizer().apply_chat_template(out, tools=_plan(HERMES).tools, tokenize=False)
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>' in text
    assert (
        "<tool_response>\n12:00\n</tool_response>" in text
        and '{"type": "function", "function": {"name": "get_time"' in text
    )


def test_template_without_tools_gets_them_as_text() -> None:
    out = chat_messages(_messages({"role": "system", "content": "Be brief."}, *TURNS), PROMPT, _plan(PROMPT))
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n")
    assert "<tools>" in out[0]["content"] and '"get_time"' in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}


def test_mistral_ids_match_between_call_and_result() -> None:
    out = chat_messages(_messages(*TURNS), MISTRAL, None)
    assert out[1]["tool_calls"][0]["id"] == out[2]["tool_call_id"]
    assert len(out[2]["tool_call_id"]) == 9


def test_tool_result_without_call_id_is_a_400() -> None:
    with pytest.raises(InvalidRequestError) as e:
        chat_messages(_messages({"role": "tool", "content": "x"}), HERMES, None)
    assert e.value.param == "messages[0].tool_call_id"


@pytest.mark.parametrize(
    "tools,choice,param",
    [
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": TIME}] * 2, None, "tools[1].function.name"),
        ([{"type": "function", "function": TIME}], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([{"type": "function", "function": TIME}], "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
        ([{"type": "function", "function": TIME}], {"type": "allowed_tools", "allowed_tools": {}}, "tool_choice"),
    ],
)
def test_bad_tools_and_tool_choice_are_400s_naming_the_field(tools, choice, param) -> None:
    body: dict = {"messages": [{"role": "user", "content": "hi"}]}
    if tools is not None:
        body["tools"] = tools
    if choice is not None:
        body["tool_choice"] = choice
    with pytest.raises(Exception) as e:
        plan_tools(ChatCompletionRequest.model_validate(body), HERMES)
    assert getattr(e.value, "param", None) == param


def test_tool_choice_none_and_no_tools_plan_nothing() -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]}
    assert plan_tools(ChatCompletionRequest.model_validate(base), HERMES) is None
    with_none = {**base, "tools": [{"type": "function", "function": TIME}], "tool_choice": "none"}
    assert plan_tools(ChatCompletionRequest.model_validate(with_none), HERMES) is None
    auto = plan_tools(ChatCompletionRequest.model_validate({**base, "tools": with_none["tools"]}), HERMES)
    assert auto is not None and auto.mode == "auto" and not auto.forced and auto.parallel
    assert json.loads(json.dumps(auto.tools))[0]["function"]["name"] == "get_time"


def _time_plan(**fields) -> object:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": TIME}]}
    return plan_tools(ChatCompletionRequest.model_validate({**body, **fields}), HERMES)


def test_how_many_calls_is_the_plans_decision() -> None:
    """A named function is called once (even with parallel calls on); ``required`` at least once, as many as
    allowed; ``parallel_tool_calls: false`` at most once — a free reply (``auto``) then ends at its first
    call's closer, and the parser keeps that call only."""
    named = _time_plan(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.parallel, named.max_calls, named.stop) == (False, 1, [])
    assert "{0," not in tool_call_grammar(named.functions, HERMES, parallel=named.parallel)  # one block, no more
    required = _time_plan(tool_choice="required")
    assert (required.parallel, required.max_calls, required.stop) == (True, None, [])
    single = _time_plan(parallel_tool_calls=False)
    assert (single.mode, single.max_calls, single.stop) == ("auto", 1, ["</tool_call>"])
    assert _time_plan().stop == [] and _time_plan().max_calls is None
    llama = plan_tools(
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": TIME}],
             "parallel_tool_calls": False}
        ),
        LLAMA,
    )  # fmt: skip
    assert llama.stop == []  # no closer to stop at: the parser alone keeps one call


@pytest.mark.parametrize("fmt, text", [(f, t) for f, t, _, calls in CASES if len(calls) > 1])
def test_parser_keeps_at_most_max_calls(fmt, text) -> None:
    whole = parse_tool_calls(text, fmt, max_calls=1)
    assert [c.name for c in whole.calls] == [parse_tool_calls(text, fmt).calls[0].name]
    for seed in range(5):  # streamed in any pieces: the same single call, nothing of the second one
        parser = ToolCallParser(fmt, max_calls=1)
        events = _stream(parser, text, seed)
        assert len(parser.calls) == 1
        assert {e.index for e in events if isinstance(e, ToolCallDelta)} == {0}
        assert "search" not in "".join(e for e in events if isinstance(e, str))
    cut = text[: text.index("}}") + 2]  # the reply stopped at the first call's closer (auto, stop string)
    assert len(parse_tool_calls(cut, fmt, max_calls=1).calls) == 1


def test_tool_schemas_close_objects_that_list_their_properties() -> None:
    """An object listing ``properties`` takes no other keys unless its schema says so (as xgrammar's strict
    mode does in vLLM); open objects, explicit choices and the request's own schema stay as they are."""
    from gateway.tools.grammar import closed_objects

    schema = {
        "type": "object",
        "properties": {
            "where": {"type": "object", "properties": {"city": {"type": "string"}}},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
            "extra": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
            "free": {"type": "object"},
            "either": {"anyOf": [{"type": "object", "properties": {"x": {}}}, {"type": "null"}]},
        },
        "$defs": {"Thing": {"type": "object", "properties": {"y": {}}, "patternProperties": {"^z": {}}}},
    }
    before = json.dumps(schema)
    closed = closed_objects(schema)
    assert json.dumps(schema) == before  # a copy
    props = closed["properties"]
    assert closed["additionalProperties"] is False and props["where"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["extra"]["additionalProperties"] is True  # said so
    assert "additionalProperties" not in props["free"]  # lists nothing: any object
    assert "additionalProperties" not in closed["$defs"]["Thing"]  # patternProperties decide
