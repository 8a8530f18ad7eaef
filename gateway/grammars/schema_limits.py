"""How big a JSON schema that constrains generation may be (``response_format``, a forced tool call's
``tools[i].function.parameters``), checked before anything is compiled: a 400 naming the limit and the
parameter, in well under a second, instead of a grammar that takes minutes to build or to mask.

OpenAI's documented limits for Structured Outputs (https://platform.openai.com/docs/guides/structured-outputs,
"Supported schemas" → "Objects have limitations on nesting depth and size"; the same figures appear in
client libraries that mirror them):

- up to 5,000 object properties in total, with up to 10 levels of nesting;
- the total string length of all property names, definition names, enum values and const values at most
  120,000 characters;
- up to 1,000 enum values across all enum properties; a single string enum of more than 250 values at most
  15,000 characters in total.

Ours, tighter, where the grammar engine (llguidance) needs it, measured with SmolLM2's 49k vocabulary:

- at most ``MAX_OPTIONAL_PROPERTIES`` optional properties in one object. Any subset of them may appear, in
  order, so one Earley row holds ~4 items per optional property; llguidance refuses rows over 2,000 items
  (``LLParserLimits.max_items_in_row``) — a 1,000-property object failed at its first token, and 10,000
  took 101 s to build. 400 builds in 0.03 s and masks in 3 ms.
- at most ``MAX_SUBSCHEMAS`` schema objects in all (``anyOf`` of 100,000 branches has no properties nor
  enums to count, and costs as much), which also bounds the time of this walk.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from typing import Any

from gateway.errors import InvalidRequestError

__all__ = [
    "LARGE_ENUM_VALUES",
    "MAX_DEPTH",
    "MAX_ENUM_VALUES",
    "MAX_LARGE_ENUM_CHARS",
    "MAX_OPTIONAL_PROPERTIES",
    "MAX_PROPERTIES",
    "MAX_STRING_CHARS",
    "MAX_SUBSCHEMAS",
    "SchemaTooLargeError",
    "SchemaTotals",
    "check_schema",
    "check_tool_schemas",
]

MAX_PROPERTIES = 5_000
MAX_DEPTH = 10
MAX_STRING_CHARS = 120_000
MAX_ENUM_VALUES = 1_000
LARGE_ENUM_VALUES, MAX_LARGE_ENUM_CHARS = 250, 15_000
MAX_OPTIONAL_PROPERTIES = 400
MAX_SUBSCHEMAS = 10_000

#: keywords whose schema (or schemas) describe a value one level down in the instance
_NESTED_ONE = ("items", "additionalProperties", "contains", "unevaluatedItems", "unevaluatedProperties")
_NESTED_MANY = ("prefixItems",)
_NESTED_MAP = ("properties", "patternProperties", "dependentSchemas")
#: keywords whose schemas describe the same value (alternatives, conditions)
_SAME_ONE = ("not", "if", "then", "else", "propertyNames")
_SAME_MANY = ("anyOf", "oneOf", "allOf")
_DEFINITIONS = ("$defs", "definitions")


class SchemaTooLargeError(InvalidRequestError):
    """A schema past one of the limits above: a 400 naming the limit and the parameter."""

    code = "schema_too_large"

    def __init__(self, param: str, what: str, limit: int, whose: str = "OpenAI's"):
        super().__init__(f"Invalid schema for {param}: {what} exceeds {whose} limit of {limit}.", param=param)


class SchemaTotals:
    """Running totals over one or more schemas (a forced tool call's functions make one grammar, so their
    schemas are counted together as well as one by one)."""

    def __init__(self, param: str):
        self.param = param
        self.properties = 0
        self.enum_values = 0
        self.string_chars = 0
        self.subschemas = 0

    def add(self, schema: Any) -> None:
        """Count ``schema`` in; a ``SchemaTooLargeError`` as soon as a limit is passed (the walk stops there,
        so its cost is bounded by the limits, not by the body)."""
        for node, depth in _walk(schema):
            self.subschemas += 1
            self._over(self.subschemas, MAX_SUBSCHEMAS, "the number of schema objects", "this server's")
            if _is_container(node):  # a leaf (a string in the 10th object) is no level of its own
                self._over(depth, MAX_DEPTH, "the nesting depth (levels of objects and arrays)")
            self._count(node)

    def _count(self, node: dict[str, Any]) -> None:
        properties = node.get("properties")
        if isinstance(properties, dict):
            self.properties += len(properties)
            self._over(self.properties, MAX_PROPERTIES, "the total number of object properties")
            self.string_chars += sum(len(str(k)) for k in properties)
            optional = _optional(node)
            what = f"the number of optional properties in one object ({optional})"
            self._over(optional, MAX_OPTIONAL_PROPERTIES, what, "this server's")
        for key in ("anyOf", "oneOf"):  # the parser tries every alternative at once: their rows add up
            branches = node.get(key)
            if isinstance(branches, list):
                optional = sum(_optional(b) for b in branches)
                what = f"the number of optional properties across the alternatives of one {key} ({optional})"
                self._over(optional, MAX_OPTIONAL_PROPERTIES, what, "this server's")
        for key in _DEFINITIONS:
            defs = node.get(key)
            if isinstance(defs, dict):
                self.string_chars += sum(len(str(k)) for k in defs)
        enum = node.get("enum")
        if isinstance(enum, list):
            self.enum_values += len(enum)
            self._over(self.enum_values, MAX_ENUM_VALUES, "the total number of enum values")
            chars = sum(len(v) for v in enum if isinstance(v, str))
            if len(enum) > LARGE_ENUM_VALUES:
                self._over(
                    chars, MAX_LARGE_ENUM_CHARS, f"the length of a string enum of over {LARGE_ENUM_VALUES} values"
                )
            self.string_chars += chars
        const = node.get("const")
        if isinstance(const, str):
            self.string_chars += len(const)
        self._over(
            self.string_chars,
            MAX_STRING_CHARS,
            "the total length of property names, definition names, enum and const values",
        )

    def _over(self, got: int, limit: int, what: str, whose: str = "OpenAI's") -> None:
        if got > limit:
            raise SchemaTooLargeError(self.param, what, limit, whose)


def check_schema(schema: Any, param: str) -> None:
    """A 400 naming ``param`` and the limit when ``schema`` is past one of the limits (module docstring)."""
    SchemaTotals(param).add(schema)


def _optional(node: Any) -> int:
    """How many of an object schema's properties are optional (0 for anything else)."""
    properties = node.get("properties") if isinstance(node, dict) else None
    if not isinstance(properties, dict):
        return 0
    required = node.get("required")
    named = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    return len(properties) - len(named.intersection(properties))


def _is_container(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    return "object" in kinds or "array" in kinds or any(k in node for k in ("properties", "items", "prefixItems"))


def _walk(schema: Any) -> Iterator[tuple[dict[str, Any], int]]:
    """Every schema object in ``schema`` with its nesting level (the root is level 1; a definition is a
    root of its own), without recursion: a schema may be nested thousands deep."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node, depth
        for key in _NESTED_ONE:
            value = node.get(key)  # ``items`` may be a list (draft 4's tuples)
            stack.extend((v, depth + 1) for v in (value if isinstance(value, list) else [value]))
        for key in _SAME_ONE:
            stack.append((node.get(key), depth))
        for key in _NESTED_MANY + _SAME_MANY:
            items = node.get(key)
            if isinstance(items, list):
                step = 1 if key in _NESTED_MANY else 0
                stack.extend((item, depth + step) for item in items)
        for key in _NESTED_MAP:
            mapping = node.get(key)
            if isinstance(mapping, dict):
                stack.extend((item, depth + 1) for item in mapping.values())
        for key in _DEFINITIONS:
            defs = node.get(key)
            if isinstance(defs, dict):
                stack.extend((item, 1) for item in defs.values())


def check_tool_schemas(tools: Sequence[dict[str, Any]], used: Collection[str]) -> None:
    """The parameters of each function in ``used`` (the ones a forced tool call's grammar holds), one by one
    (a 400 naming ``tools[i].function.parameters``) and together (one grammar: a 400 naming ``tools``)."""
    together = SchemaTotals("tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") or {}
        if function.get("name") not in used:
            continue
        parameters = function.get("parameters") or {}
        check_schema(parameters, f"tools[{i}].function.parameters")
        together.add(parameters)
