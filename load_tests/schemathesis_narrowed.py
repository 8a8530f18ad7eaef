"""Schemathesis over valid-shaped requests only: the gateway's OpenAPI schema is narrowed before fuzzing so
that (almost) every generated request reaches generation, then the 3 generation operations are fuzzed in
positive mode against a real uvicorn gateway (``schemathesis_500.served_gateway``: ``LocalBackend`` over a
random tiny Llama). The answer must never be a 5xx.

    python load_tests/schemathesis_narrowed.py [--examples 300] [--out load_tests/results/FILE.json]

``schemathesis_500.py`` fuzzes the raw schema, where most "valid" requests are 400s before generation (a
random model name, a message without content...). Here ``model`` is the served id, messages have a role
from the enum and string content (plus assistant tool calls and tool results), budgets are 1-16 tokens,
``n`` 1-2, token ids and ``logit_bias`` keys lie in the vocabulary, ``response_format``/``text.format`` and
``tools`` are drawn from small valid shapes, and the fields the gateway rejects outright (``audio``,
``suffix``, ``background``...) are left out. Every sampling field keeps its documented range, so hypothesis
explores temperature, top_p, top_k, min_p, penalties, logit_bias, logprobs, seed, stop and streaming.
Writes examples, answers by status, the share answered 200, the commonest 400 messages and every 5xx
(status, body, curl) per operation to ``--out``; exits 1 if any answer was a 5xx.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import schemathesis  # noqa: E402
import torch  # noqa: E402

from load_tests.schemathesis_500 import MAX_N, MAX_TOKENS, fuzz, served_gateway  # noqa: E402
from swarm_client.tiny_model import build_tokenizer  # noqa: E402

OPERATIONS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
VOCAB = len(build_tokenizer("llama"))  # the served tiny Llama's tokenizer: token ids lie in [0, VOCAB)
TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": VOCAB - 1}
SHORT_TEXT = {"type": "string", "maxLength": 80}
PROMPT_TEXT = {"type": "string", "minLength": 1, "maxLength": 80}  # an empty prompt is a 400 by design


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


BUDGET = _nullable({"type": "integer", "minimum": 1, "maximum": MAX_TOKENS})
N = _nullable({"type": "integer", "minimum": 1, "maximum": MAX_N})
TOP_K = _nullable({"type": "integer", "minimum": -1})
LOGIT_BIAS = _nullable(
    {
        "type": "object",
        "maxProperties": 4,
        "propertyNames": {"pattern": r"^(0|[1-9][0-9]{0,2})$"},  # ids 0-999, all below VOCAB
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    }
)
# A few small JSON schemas the structured-output grammar must compile and follow.
JSON_SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}}},
    {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    {"type": "string", "enum": ["yes", "no"]},
]
TOOL_PARAMETERS = _nullable({"enum": [*JSON_SCHEMAS[:2], {"type": "object", "properties": {}}]})
TOOL_NAME = {"type": "string", "pattern": r"^[a-z_]{1,12}$"}


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required or [], "additionalProperties": False}


def _json_schema_format(nested: bool) -> dict[str, Any]:
    """``response_format`` (``nested``: ``json_schema: {name, schema}``) or Responses ``text.format`` (flat)."""
    spec = {"name": TOOL_NAME, "schema": {"enum": JSON_SCHEMAS}, "strict": _nullable({"type": "boolean"})}
    if nested:
        return _object(
            {"type": {"const": "json_schema"}, "json_schema": _object(spec, ["name", "schema"])},
            ["type", "json_schema"],
        )
    return _object({"type": {"const": "json_schema"}, **spec}, ["type", "name", "schema"])


def _format(nested: bool) -> dict[str, Any]:
    plain = _object({"type": {"enum": ["text", "json_object"]}}, ["type"])
    return _nullable({"anyOf": [plain, _json_schema_format(nested)]})


CHAT_MESSAGE = {
    "anyOf": [
        _object(
            {"role": {"enum": ["system", "developer", "user", "assistant"]}, "content": SHORT_TEXT, "name": TOOL_NAME},
            ["role", "content"],
        ),
        _object(
            {
                "role": {"const": "assistant"},
                "content": _nullable(SHORT_TEXT),
                "tool_calls": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2,
                    "items": _object(
                        {
                            "id": {"type": "string", "pattern": r"^call_[a-z0-9]{1,8}$"},
                            "type": {"const": "function"},
                            "function": _object(
                                {"name": TOOL_NAME, "arguments": {"enum": ["{}", '{"a": 1}', '{"name": "x"}']}},
                                ["name", "arguments"],
                            ),
                        },
                        ["id", "type", "function"],
                    ),
                },
            },
            ["role", "tool_calls"],
        ),
        _object(
            {
                "role": {"const": "tool"},
                "tool_call_id": {"type": "string", "pattern": r"^call_[a-z0-9]{1,8}$"},
                "content": SHORT_TEXT,
            },
            ["role", "tool_call_id", "content"],
        ),
    ]
}
CHAT_TOOLS = _nullable(
    {
        "type": "array",
        "minItems": 1,
        "maxItems": 3,
        "items": _object(
            {
                "type": {"const": "function"},
                "function": _object(
                    {
                        "name": TOOL_NAME,
                        "description": _nullable(SHORT_TEXT),
                        "parameters": TOOL_PARAMETERS,
                        "strict": _nullable({"type": "boolean"}),
                    },
                    ["name"],
                ),
            },
            ["type", "function"],
        ),
    }
)
PROMPT = {
    "anyOf": [
        PROMPT_TEXT,
        {"type": "array", "minItems": 1, "maxItems": 2, "items": PROMPT_TEXT},
        {"type": "array", "minItems": 1, "maxItems": 16, "items": TOKEN_ID},
        {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {"type": "array", "minItems": 1, "maxItems": 16, "items": TOKEN_ID},
        },
    ]
}
RESPONSES_INPUT = {
    "anyOf": [
        SHORT_TEXT,
        {
            "type": "array",
            "minItems": 1,
            "maxItems": 4,
            "items": _object(
                {
                    "type": {"const": "message"},
                    "role": {"enum": ["user", "system", "developer", "assistant"]},
                    "content": SHORT_TEXT,
                },
                ["role", "content"],
            ),
        },
    ]
}
# Per operation: fields replaced, fields dropped (each is a 400 by design here), fields made required.
NARROWING: dict[str, tuple[dict[str, Any], tuple[str, ...], tuple[str, ...]]] = {
    "/v1/chat/completions": (
        {
            "messages": {"type": "array", "minItems": 1, "maxItems": 4, "items": CHAT_MESSAGE},
            "max_tokens": BUDGET,
            "max_completion_tokens": BUDGET,
            "n": N,
            "top_k": TOP_K,
            "logit_bias": LOGIT_BIAS,
            "response_format": _format(nested=True),
            "tools": CHAT_TOOLS,
            "tool_choice": _nullable({"enum": ["auto", "none", "required"]}),
        },
        ("audio", "function_call", "functions", "modalities", "prediction", "reasoning_effort"),
        ("model", "messages"),
    ),
    "/v1/completions": (
        {
            "prompt": PROMPT,
            "max_tokens": BUDGET,
            "n": N,
            "top_k": TOP_K,
            "logit_bias": LOGIT_BIAS,
            "response_format": _format(nested=True),
        },
        ("suffix", "best_of"),
        ("model", "prompt"),
    ),
    "/v1/responses": (
        {
            "input": RESPONSES_INPUT,
            "instructions": _nullable(SHORT_TEXT),
            "max_output_tokens": BUDGET,
            "top_k": TOP_K,
            "text": _nullable(_object({"format": _format(nested=False)})),
            "tool_choice": _nullable({"enum": ["auto", "none"]}),
            "truncation": _nullable({"enum": ["auto", "disabled"]}),
        },
        (
            "background",
            "conversation",
            "include",
            "previous_response_id",
            "prompt",
            "reasoning",
            "tools",
            "top_logprobs",
            "max_tool_calls",
        ),
        ("model", "input"),
    ),
}


def narrow(raw: dict[str, Any], model_id: str) -> dict[str, Any]:
    """``raw`` (the served OpenAPI document) with the generation operations narrowed as ``NARROWING`` says
    and every other operation removed."""
    doc = copy.deepcopy(raw)
    doc["paths"] = {path: doc["paths"][path] for path in OPERATIONS}
    for path, (replaced, dropped, required) in NARROWING.items():
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        props = body["properties"]
        for name in dropped:
            props.pop(name)
        props.update(replaced)
        props["model"] = {"type": "string", "enum": [model_id]}
        body["required"] = sorted(set(body.get("required", [])) | set(required))
        body["additionalProperties"] = False  # unknown fields are ignored: they would only cost examples
    return doc


def integral_floats_to_ints(value: Any) -> Any:
    """``value`` with every integral float (``4.0``) an int, in place for dicts and lists. JSON Schema counts
    ``4.0`` as an integer and hypothesis draws such values for ``"type": "integer"``; the gateway's pydantic
    models refuse them with a 400 (not a 5xx), which would only cost examples here."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        for key, item in value.items():
            value[key] = integral_floats_to_ints(item)
    elif isinstance(value, list):
        value[:] = [integral_floats_to_ints(item) for item in value]
    return value


def stream_error(response: Any) -> str | None:
    """The error frame of a 200 stream that failed after it started (``data: {"error": ...}`` on chat and
    completions, ``event: error`` on Responses), else None: such a stream is a server error behind a 200."""
    if "text/event-stream" not in response.headers.get("content-type", ""):
        return None
    lines = response.text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith('data: {"error"'):
            return line[6:2006]
        if line.strip() == "event: error":
            return "\n".join(lines[i : i + 2])[:2000]
    return None


def _message(response: Any) -> str:
    """A 400's error message, cut short (so alike ones count together)."""
    try:
        return str(response.json()["error"]["message"])[:120]
    except (ValueError, KeyError, TypeError):
        return response.text[:120]


def fuzz_operation(schema: Any, path: str, examples: int) -> dict[str, Any]:
    """``examples`` valid-shaped requests to ``POST path``: answers by status, the commonest 400 messages,
    every 5xx and every error inside a 200 stream."""
    rejections: Counter[str] = Counter()
    broken_streams: list[dict[str, Any]] = []

    def observe(case: Any, response: Any) -> None:
        if response.status_code == 400:
            rejections[_message(response)] += 1
        error = stream_error(response) if response.status_code == 200 else None
        if error is not None:
            broken_streams.append({"error": error, "curl": case.as_curl_command()})

    result = fuzz(schema, "POST", path, "positive", examples, observe, integral_floats_to_ints)
    ok = result["statuses"].get("200", 0)
    result["reached_generation"] = ok
    result["reached_generation_share"] = round(ok / max(result["examples"], 1), 3)
    result["top_400_messages"] = dict(rejections.most_common(10))
    result["stream_errors"] = len(broken_streams)
    result["stream_error_cases"] = broken_streams[:20]
    print(json.dumps({k: v for k, v in result.items() if not k.endswith(("failures", "cases"))}), flush=True)
    for failure in result["failures"]:
        print("  5xx:", failure["curl"], "->", failure["body"][:300], flush=True)
    for broken in broken_streams[:20]:
        print("  error in a 200 stream:", broken["curl"], "->", broken["error"][:300], flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--only", default="", help="fuzz only operations whose path contains this")
    parser.add_argument("--out", type=Path, default=ROOT / "bench_results" / "schemathesis-narrowed.json")
    args = parser.parse_args()

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)
    results = []
    with served_gateway() as url:
        raw = httpx.get(f"{url}/openapi.json", timeout=30).json()
        model_id = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        schema = schemathesis.openapi.from_dict(narrow(raw, model_id))
        schema.config.update(base_url=url)
        for path in OPERATIONS:
            if not args.only or args.only in path:
                results.append(fuzz_operation(schema, path, args.examples))
    examples = sum(r["examples"] for r in results)
    reached = sum(r["reached_generation"] for r in results)
    summary = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "schemathesis": schemathesis.__version__,
        "max_examples_per_operation": args.examples,
        "examples": examples,
        "reached_generation": reached,
        "reached_generation_share": round(reached / max(examples, 1), 3),
        "server_errors": sum(r["server_errors"] for r in results),
        "stream_errors": sum(r["stream_errors"] for r in results),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"{examples} examples, {summary['reached_generation_share']:.0%} answered 200: "
        f"{summary['server_errors']} 5xx, {summary['stream_errors']} errors inside 200 streams"
    )
    print(f"wrote {args.out}")
    sys.exit(1 if summary["server_errors"] or summary["stream_errors"] else 0)


if __name__ == "__main__":
    main()
