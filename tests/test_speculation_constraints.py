"""Speculation under constraints: guesses that a grammar (structured outputs, a forced tool call) governs are
kept exactly as plain decoding would sample them, so output with speculation on is identical to off.

The guesses here are made to be kept: the request's ``prediction`` is the text plain decoding wrote, so the
prompt-lookup drafter copies it and a step carries (and keeps) several tokens, the grammar's last one among
them. That is where the audit saw JSON cut short with ``finish_reason: "stop"`` (the choice ended on the
step's first token once the grammar was complete after its last) and ``"\\n</tool"`` leaking into content.
The in-process gateway runs the tiny random Llama; ``slow`` tests run a real 2-worker swarm, and the real
SmolLM2 copying JSON out of its prompt (the audit's case, with no prediction: lookup drafts from the prompt).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch

from gateway.backends.local import LocalBackend
from tests.gateway_fixtures import Gateway, InstrumentedBackend, start_gateway, swarm_gateway, tiny_model_dir
from tests.swarm_fixtures import swarm
from tests.test_structured_outputs import HELLO, JSON_SCHEMA, MAX_TOKENS, assert_valid
from tests.test_tool_calling import ASK, TOOLS, assert_call_valid

SEEDS = range(30)
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    """A gateway of its own whose backend returns every position's logits (the shared one decodes plainly)."""
    torch.set_num_threads(1)
    gw = start_gateway(InstrumentedBackend(LocalBackend(tiny_model_dir()), speculate=True))
    try:
        yield gw
    finally:
        gw.server.stop()


def _pair(client: openai.OpenAI, **kw: Any) -> tuple[Any, Any]:
    """The same request without speculation, then with prompt lookup given the first answer's text as its
    ``prediction`` (so its guesses are the very tokens plain decoding sampled)."""
    off = client.chat.completions.create(extra_body={"speculation": "off"}, **kw).choices[0]
    reference = off.message.content
    if reference is None:  # a tool call: predict the call's text as the model wrote it
        reference = _call_text(off)
    on = client.chat.completions.create(
        extra_body={"speculation": "prompt_lookup"}, prediction={"type": "content", "content": reference}, **kw
    )
    return off, on


def _call_text(choice: Any) -> str:
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    body = json.dumps({"name": call.function.name, "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _accepted(response: Any) -> int:
    details = response.usage.completion_tokens_details
    return details.accepted_prediction_tokens if details is not None else 0


def test_json_schema_with_kept_guesses_equals_plain_decoding(gw: Gateway) -> None:
    client = gw.client()
    kept = 0
    for seed in SEEDS:
        for temperature in (0.0, 1.0) if seed < 5 else (1.0,):
            kw = dict(
                model=gw.model, messages=HELLO, max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                response_format=JSON_SCHEMA,
            )  # fmt: skip
            off, on_response = _pair(client, **kw)
            on = on_response.choices[0]
            assert (on.message.content, on.finish_reason) == (off.message.content, off.finish_reason), seed
            assert on.finish_reason == "stop"
            assert_valid(on.message.content)
            kept += _accepted(on_response)
    assert kept > 100  # the guesses were kept (copied from the prediction), so the case is exercised


def test_named_tool_choice_with_kept_guesses_is_one_call(gw: Gateway) -> None:
    client = gw.client()
    kept = 0
    for seed in range(10):
        kw = dict(
            model=gw.model, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=seed,
            max_tokens=200,
        )  # fmt: skip
        off, on_response = _pair(client, **kw)
        on = on_response.choices[0]
        for choice in (off, on):
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            (call,) = choice.message.tool_calls  # a named choice is exactly one call
            assert call.function.name == "get_weather"
            assert_call_valid(call.function.name, call.function.arguments)
        assert on.message.tool_calls[0].function.arguments == off.message.tool_calls[0].function.arguments
        kept += _accepted(on_response)
    assert kept > 50


def test_guesses_the_grammar_forbids_are_not_sent(gw: Gateway) -> None:
    """``GrammarConstraint.accepted_prefix`` counts the guesses the grammar takes from its state (which it
    leaves as it was), and a choice's speculator sends only those: the rest could never be kept."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    from gateway.decode.prompting import eos_token_ids
    from gateway.grammars.structured import StructuredOutputs
    from gateway.speculation.verify import ChoiceSpeculator, StepCosts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    eos = eos_token_ids(gw.backend)
    structured = StructuredOutputs(tokenizer, eos, ThreadPoolExecutor(1))
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    make = asyncio.run(structured.compile({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}))
    constraint = make()
    encode = tokenizer.encode
    for token in encode('{"a":', add_special_tokens=False):
        constraint.consume(token)
    digits, words = encode("12,", add_special_tokens=False), encode("zz", add_special_tokens=False)
    assert constraint.accepted_prefix(digits + words) == len(digits)
    assert constraint.accepted_prefix(words + digits) == 0
    assert constraint.accepted_prefix([*digits, min(eos), *digits]) == len(digits)  # an EOS guess ends them
    assert constraint.accepted_prefix(digits) == len(digits)  # the state did not move

    class Scripted:
        name = "prompt_lookup"

        def propose(self, context: list[int], k: int) -> list[int]:
            return (digits + words)[:k]

        def close(self) -> None:
            pass

    guesses = len(digits + words)
    speculator = ChoiceSpeculator(Scripted(), StepCosts(), guesses, [1, 2, 3], 40, admit=constraint.accepted_prefix)
    drafts = speculator.drafts()
    assert drafts and drafts == digits[: len(drafts)]  # guesses were asked for; none the grammar forbids is sent


# ------------------------------------------------------------------------------------------- over a swarm


@pytest.fixture(scope="module")
def swarm_gw(calm_swarm_gateway: Gateway) -> Gateway:
    return calm_swarm_gateway


@pytest.mark.slow
def test_constrained_speculation_over_a_two_worker_swarm(swarm_gw: Gateway) -> None:
    client = swarm_gw.client()
    kept = 0
    for seed in range(8):
        kw = dict(
            model=swarm_gw.model, messages=HELLO, max_tokens=MAX_TOKENS, temperature=1.0 if seed else 0.0,
            seed=seed, response_format=JSON_SCHEMA,
        )  # fmt: skip
        off, on_response = _pair(client, **kw)
        on = on_response.choices[0]
        assert (on.message.content, on.finish_reason) == (off.message.content, "stop")
        assert_valid(on.message.content)
        kept += _accepted(on_response)
        tool_kw = dict(
            model=swarm_gw.model, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=seed,
            max_tokens=200,
        )  # fmt: skip
        off, on_response = _pair(client, **tool_kw)
        on = on_response.choices[0]
        assert on.message.content is None and len(on.message.tool_calls) == 1
        assert on.message.tool_calls[0].function.arguments == off.message.tool_calls[0].function.arguments
    assert kept > 20


# ------------------------------------------------------------------- the audit's case: SmolLM2, JSON in the prompt

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
EXTRACT = [
    {
        "role": "user",
        "content": 'Here is a record: {"name":"Li Wei","age":31,"city":"Oslo"}. Return the person in this '
        "record as JSON with the keys name, age and city.",
    }
]


@pytest.fixture(scope="module")
def smollm2_swarm_gw(smollm2_path: str) -> Iterator[Gateway]:
    with (
        swarm(smollm2_path, ["0:15", "15:30"]) as s,
        swarm_gateway(smollm2_path, s.initial_peers) as gw,
    ):
        yield gw


@pytest.mark.slow
def test_smollm2_extracting_json_from_its_prompt_with_lookup_speculation(smollm2_swarm_gw: Gateway) -> None:
    """The gateway's default speculation (prompt lookup) copies the record out of the prompt, so guesses are
    kept: 30 sampled answers (n=10, three seeds) that end with ``stop`` all validate, and greedy decoding is
    the same with speculation on and off; the same for a named tool call (content null, one call)."""
    import jsonschema_rs

    gw = smollm2_swarm_gw
    client = gw.client(timeout=300)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw: dict[str, Any] = dict(model=gw.model, messages=EXTRACT, max_tokens=40, response_format=fmt)
    kept = stopped = 0
    for seed in range(3):
        r = client.chat.completions.create(n=10, seed=seed, temperature=1.0, **kw)
        kept += _accepted(r)
        for choice in r.choices:
            if choice.finish_reason == "stop":
                stopped += 1
                jsonschema_rs.validate(PERSON, json.loads(choice.message.content))
    assert stopped >= 20 and kept > 0  # most answers complete, and guesses were kept on the way
    greedy = client.chat.completions.create(temperature=0, **kw)
    plain = client.chat.completions.create(temperature=0, extra_body={"speculation": "off"}, **kw)
    assert greedy.choices[0].message.content == plain.choices[0].message.content
    assert json.loads(greedy.choices[0].message.content)["name"] == "Li Wei"
    assert _accepted(greedy) > 0
    tool = {
        "type": "function",
        "function": {"name": "save_person", "parameters": PERSON, "strict": True},
    }
    tool_kw: dict[str, Any] = dict(
        model=gw.model, messages=EXTRACT, tools=[tool], max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "save_person"}},
    )  # fmt: skip
    on = client.chat.completions.create(**tool_kw).choices[0]
    off = client.chat.completions.create(extra_body={"speculation": "off"}, **tool_kw).choices[0]
    for choice in (on, off):
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        jsonschema_rs.validate(PERSON, json.loads(call.function.arguments))
    assert on.message.tool_calls[0].function.arguments == off.message.tool_calls[0].function.arguments
