"""Structured outputs (``response_format``) with the official OpenAI SDK: the in-process gateway over a tiny
random Llama (LocalBackend), and one test over a real 2-worker swarm.

The model is random: left alone it writes no JSON at all, so every valid answer here is the grammar's work.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.gateway_fixtures import Gateway, collect_stream, shared_gateway

HELLO = [{"role": "user", "content": "Describe a server of the swarm as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "blocks": {"type": "integer", "minimum": 0, "maximum": 999},
        "online": {"type": "boolean"},
        "state": {"enum": ["JOINING", "ONLINE", "OFFLINE"]},
        "peers": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "blocks", "online", "state", "peers"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "server", "schema": SCHEMA, "strict": True}}
#: enough for any instance of SCHEMA (compact JSON, every string bounded), so none is cut by max_tokens
MAX_TOKENS = 160


def assert_valid(text: str) -> dict:
    """``text`` is one JSON instance of SCHEMA (checked with jsonschema_rs when installed, else by hand)."""
    value = json.loads(text)
    assert list(value) == list(SCHEMA["properties"])  # in the schema's order, as OpenAI writes them
    try:
        import jsonschema_rs
    except ImportError:
        assert isinstance(value, dict) and set(value) == set(SCHEMA["properties"])
        assert isinstance(value["name"], str) and len(value["name"]) <= 12
        assert isinstance(value["blocks"], int) and 0 <= value["blocks"] <= 999
        assert isinstance(value["online"], bool) and value["state"] in ("JOINING", "ONLINE", "OFFLINE")
        assert isinstance(value["peers"], list) and len(value["peers"]) <= 2
    else:
        jsonschema_rs.validate(SCHEMA, value)
    return value


@pytest.fixture(scope="module")
def gw() -> Gateway:
    return shared_gateway()


@pytest.fixture(scope="module")
def client(gw: Gateway) -> openai.OpenAI:
    return gw.client()


def test_json_schema_valid_for_20_seeds_at_temperature_1(gw: Gateway, client: openai.OpenAI) -> None:
    kw = dict(model=gw.model, messages=HELLO, max_tokens=MAX_TOKENS, temperature=1.0, response_format=JSON_SCHEMA)
    texts = set()
    for seed in range(20):
        r = client.chat.completions.create(seed=seed, **kw)
        (choice,) = r.choices
        assert choice.finish_reason == "stop", choice.message.content
        assert_valid(choice.message.content)
        texts.add(choice.message.content)
    assert len(texts) > 10  # sampled, not one fixed answer
    again = client.chat.completions.create(seed=7, **kw)  # seeds still reproduce
    assert again.choices[0].message.content == client.chat.completions.create(seed=7, **kw).choices[0].message.content
    assert gw.backend.wait_all_closed()


def test_unconstrained_random_model_writes_no_json(gw: Gateway, client: openai.OpenAI) -> None:
    # the control: without response_format the same requests are not JSON, so the tests above can fail
    kw = dict(model=gw.model, messages=HELLO, max_tokens=40, temperature=1.0)
    for seed in range(5):
        text = client.chat.completions.create(seed=seed, **kw).choices[0].message.content
        with pytest.raises(ValueError):
            json.loads(text)


def test_json_object_parses_streamed_and_with_n(gw: Gateway, client: openai.OpenAI) -> None:
    kw = dict(
        model=gw.model,
        messages=HELLO,
        max_tokens=MAX_TOKENS,
        temperature=0.7,
        seed=3,
        n=2,
        response_format={"type": "json_object"},
    )
    r = client.chat.completions.create(**kw)
    assert len(r.choices) == 2
    for c in r.choices:
        if c.finish_reason == "stop":  # an object may be unbounded: one cut by max_tokens is not JSON yet
            assert isinstance(json.loads(c.message.content), dict)
        else:
            assert c.finish_reason == "length" and c.message.content.startswith("{")
    texts, finishes, _ = collect_stream(client.chat.completions.create(stream=True, **kw))
    assert texts == {c.index: c.message.content for c in r.choices}  # seeded: the same draws
    assert finishes == {c.index: c.finish_reason for c in r.choices}


def test_streamed_equals_non_streamed_for_greedy_and_n(gw: Gateway, client: openai.OpenAI) -> None:
    kw = dict(model=gw.model, messages=HELLO, max_tokens=MAX_TOKENS, temperature=0, n=2, response_format=JSON_SCHEMA)
    full = client.chat.completions.create(**kw)
    texts, finishes, _ = collect_stream(client.chat.completions.create(stream=True, **kw))
    for c in full.choices:
        assert c.finish_reason == "stop"
        assert_valid(c.message.content)
        assert (texts[c.index], finishes[c.index]) == (c.message.content, c.finish_reason)
    assert full.choices[0].message.content == full.choices[1].message.content


def test_n_2_sampled_choices_each_valid(gw: Gateway, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=gw.model, messages=HELLO, max_tokens=MAX_TOKENS, n=2, seed=11, response_format=JSON_SCHEMA
    )
    assert [c.index for c in r.choices] == [0, 1]
    values = [assert_valid(c.message.content) for c in r.choices]
    assert values[0] != values[1]  # distinct seeds per choice


def test_max_tokens_cut_is_length(gw: Gateway, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=gw.model, messages=HELLO, max_tokens=3, temperature=0, response_format=JSON_SCHEMA
    )
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    assert r.usage.completion_tokens == 3


def test_completions_accept_response_format(gw: Gateway, client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=gw.model,
        prompt="The server:",
        max_tokens=MAX_TOKENS,
        seed=5,
        extra_body={"response_format": JSON_SCHEMA},
    )
    assert r.choices[0].finish_reason == "stop"
    assert_valid(r.choices[0].text)


@pytest.mark.parametrize(
    "response_format, names",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}, "nope"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}, "missing"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "name"),
        ({"type": "yaml"}, "yaml"),
    ],
)
def test_bad_schema_is_a_400_naming_response_format(
    gw: Gateway, client: openai.OpenAI, response_format: dict, names: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=gw.model, messages=HELLO, max_tokens=4, response_format=response_format)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["param"] == "response_format"
    assert names in body["message"] and body["type"] == "invalid_request_error"
    assert gw.backend.wait_all_closed()


# ------------------------------------------------------------------------------------------- over a swarm


@pytest.fixture(scope="module")
def swarm_gw(calm_swarm_gateway: Gateway) -> Gateway:
    return calm_swarm_gateway


@pytest.mark.slow
def test_json_schema_over_a_two_worker_swarm(swarm_gw: Gateway) -> None:
    client = swarm_gw.client()
    kw = dict(model=swarm_gw.model, messages=HELLO, max_tokens=MAX_TOKENS, response_format=JSON_SCHEMA)
    for seed in range(20):  # the grammar, not the random model, makes every one of them valid
        r = client.chat.completions.create(seed=seed, temperature=1.0, n=2 if seed == 0 else 1, **kw)
        for c in r.choices:
            assert c.finish_reason == "stop"
            assert_valid(c.message.content)
    full = client.chat.completions.create(temperature=0, **kw)
    texts, finishes, _ = collect_stream(client.chat.completions.create(temperature=0, stream=True, **kw))
    assert (texts[0], finishes[0]) == (full.choices[0].message.content, "stop")
    assert_valid(texts[0])
    obj = client.chat.completions.create(
        temperature=0,
        response_format={"type": "json_object"},
        **{k: v for k, v in kw.items() if k != "response_format"},
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
