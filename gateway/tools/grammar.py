"""The grammar that makes a reply a tool call when the request demands one (``tool_choice: "required"`` or a
named function), in llguidance's Lark syntax with the calls' JSON schemas inlined (``%json``).

The grammar writes calls exactly as the served model's format does (gateway/tools/formats.py), with the
arguments an instance of the function's ``parameters`` schema, so every call parses and validates. JSON is
written with Python's separators (``", "``, ``": "``) and nothing else between tokens: the chat template
renders the call back the same way in the next turn, so the servers' cache of this reply is reused, and
a model fond of blanks cannot spend ``max_tokens`` on them. A function marked ``strict`` gets every keyword
of its schema enforced (one the engine cannot enforce is a 400); otherwise unsupported keywords are ignored.

An object that lists its ``properties`` and says nothing of others takes no others (``additionalProperties:
false``, as vLLM's xgrammar does in its default strict mode): the function declares what it accepts, and an
argument it does not declare is of no use to it, while a schema left open lets a model write invented keys
until ``max_tokens`` cuts the call (LangChain's and instructor's tool schemas leave objects open).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.tools.formats import JSON_SEPARATORS, ToolFormat

__all__ = ["MAX_PARALLEL_CALLS", "closed_objects", "tool_call_grammar"]

#: most calls one reply may make when ``parallel_tool_calls`` is on (a random model would go on forever)
MAX_PARALLEL_CALLS = 8


#: keywords whose value is a schema, a list of schemas, or a mapping of names to schemas
_SCHEMA_KEYS = ("items", "additionalItems", "not", "if", "then", "else", "contains")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists ``properties`` and sets
    neither ``additionalProperties`` nor ``patternProperties`` (a copy; the request's schema is not changed)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_KEYS:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("properties"), dict) and not {"additionalProperties", "patternProperties"} & out.keys():
        out["additionalProperties"] = False
    return out


def _call_schema(function: dict[str, Any], fmt: ToolFormat) -> dict[str, Any]:
    parameters = closed_objects(function.get("parameters") or {"type": "object"})
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, fmt.arguments_key: parameters},
        "required": ["name", fmt.arguments_key],
        "additionalProperties": False,
    }


def _calls_schema(functions: Sequence[dict[str, Any]], fmt: ToolFormat) -> dict[str, Any]:
    schemas = [_call_schema(f, fmt) for f in functions]
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    item, key = JSON_SEPARATORS
    strict = all(f.get("strict") for f in functions)
    schema = dict(schema)
    schema["x-guidance"] = {
        "whitespace_flexible": False,
        "item_separator": item,
        "key_separator": key,
        "lenient": not strict,
    }
    return schema


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal is a JSON string


def tool_call_grammar(
    functions: Sequence[dict[str, Any]], fmt: ToolFormat, *, parallel: bool, opener_token: int | None = None
) -> str:
    """Lark text of "one or more calls (one if not ``parallel``) to ``functions``" in ``fmt``.

    ``functions`` are OpenAI ``function`` objects (``name``, ``parameters``, ``strict``); ``opener_token``
    is the id of the opener when the tokenizer has it as one special token (``[TOOL_CALLS]``), which the
    grammar must then produce as that token rather than as text.
    """

    def more(separator: str, item: str) -> str:  # the calls after the first one
        return f" ({_literal(separator)} {item}){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else ""

    call = "%json " + json.dumps(_calls_schema(functions, fmt), separators=(",", ":"))
    if fmt.array:  # mistral: [TOOL_CALLS] [{...}, {...}]
        opener = f"<[{opener_token}]>" if opener_token is not None else _literal(fmt.opener or "")
        return "\n".join(
            [
                f'start: {opener} " [" call{more(", ", "call")} "]"',
                f"call: {call}",
            ]
        )
    if fmt.opener is None:  # llama3_json: {...}; {...}
        return "\n".join([f"start: call{more('; ', 'call')}", f"call: {call}"])
    assert fmt.closer is not None
    return "\n".join(
        [
            f"start: block{more(chr(10), 'block')}",
            f"block: {_literal(fmt.opener + chr(10))} call {_literal(chr(10) + fmt.closer)}",
            f"call: {call}",
        ]
    )
