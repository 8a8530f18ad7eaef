"""Tool calling for chat completions: which tools a request offers and what it demands (``ToolPlan``), checked
before anything runs, and the instructions a chat template that knows no tools gets instead.

``tool_choice``: ``"none"`` (the default without tools) answers text and leaves the tools out of the
prompt; ``"auto"`` (the default with tools) renders them through the chat template and parses whatever
calls the model writes (gateway/tools/parser.py); ``"required"`` and a named function also force the reply
to be calls, through a grammar (gateway/tools/grammar.py), so their arguments always parse against the
function's schema. How many calls a reply makes is the grammar's decision, not the model's: a named function
is called exactly once, ``required`` makes at least one call, and ``parallel_tool_calls: false`` at most one
(forced: the grammar writes one; ``auto``: the reply ends with its first call's closer and nothing after the
first call is parsed). ``parallel_tool_calls`` (default true) allows several calls in one reply otherwise.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from gateway.errors import InvalidRequestError, UnsupportedParameterError
from gateway.grammars.schema_limits import check_tool_schemas
from gateway.schema.requests import ChatCompletionRequest
from gateway.tools.formats import ToolFormat
from gateway.tools.parser import ToolCallParser

__all__ = ["ToolPlan", "plan_tools", "tool_instructions"]

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")

ToolMode = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """The tools a chat request offers, in the served model's format, and how it wants them used."""

    fmt: ToolFormat
    #: OpenAI ``tools`` entries as the chat template takes them
    tools: list[dict[str, Any]]
    mode: ToolMode
    #: the function ``tool_choice`` names (mode ``named``)
    named: str | None
    #: several calls in one reply (never for a named function: it is called once)
    parallel: bool

    @property
    def forced(self) -> bool:
        """The reply must be calls: a grammar makes it so."""
        return self.mode != "auto"

    @property
    def functions(self) -> list[dict[str, Any]]:
        """The functions a forced reply may call."""
        every = [t["function"] for t in self.tools]
        return [f for f in every if f["name"] == self.named] if self.mode == "named" else every

    @property
    def max_calls(self) -> int | None:
        """The most calls one reply may make (None: as many as the grammar or the model write)."""
        return None if self.parallel else 1

    @property
    def stop(self) -> list[str]:
        """Stop strings the plan adds: a free reply (``auto``) limited to one call ends at that call's closer
        (the parser reads the call complete without it); the grammar of a forced reply ends it by itself."""
        return [self.fmt.closer] if self.mode == "auto" and not self.parallel and self.fmt.closer else []

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.fmt, self.max_calls)


def plan_tools(req: ChatCompletionRequest, fmt: ToolFormat) -> ToolPlan | None:
    """The request's tools and ``tool_choice``, checked (a 400 naming the field otherwise); None when no
    tool is in play (no tools, or ``tool_choice: "none"``)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    names: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if not _NAME.match(name):
            raise InvalidRequestError(
                f"tools[{i}].function.name: {name!r} must be 1-64 letters, digits, '_' or '-'.",
                param=f"tools[{i}].function.name",
            )
        if name in names:
            raise InvalidRequestError(
                f"tools[{i}].function.name: {name!r} is defined twice.", param=f"tools[{i}].function.name"
            )
        names.add(name)
    mode, named = _choice(req.tool_choice, names)
    if mode == "none" or not tools:
        return None
    parallel = req.parallel_tool_calls is not False and mode != "named"
    plan = ToolPlan(fmt, tools, mode, named, parallel)
    if plan.forced:  # their schemas make a grammar: a 400 naming a size limit before anything else runs
        check_tool_schemas(plan.tools, {f["name"] for f in plan.functions})
    return plan


def _choice(choice: str | dict[str, Any] | None, names: set[str]) -> tuple[ToolMode | Literal["none"], str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"tool_choice: expected 'none', 'auto', 'required' or a function, got {choice!r}.",
                param="tool_choice",
            )
        if choice == "required" and not names:
            raise InvalidRequestError("tool_choice: 'required' needs tools.", param="tool_choice")
        if choice == "none" or not names:
            return "none", None
        return ("auto" if choice == "auto" else "required"), None
    kind = choice.get("type")
    if kind == "allowed_tools":
        raise UnsupportedParameterError("tool_choice", "of type 'allowed_tools' is not supported")
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if kind != "function" or not isinstance(name, str):
        raise InvalidRequestError(
            "tool_choice: a named choice is {'type': 'function', 'function': {'name': ...}}.", param="tool_choice"
        )
    if name not in names:
        raise InvalidRequestError(f"tool_choice: function {name!r} is not among tools.", param="tool_choice")
    return "named", name


def tool_instructions(tools: list[dict[str, Any]], fmt: ToolFormat) -> str:
    """The system text that teaches the tools and the call syntax to a model whose chat template has no
    tools (the Hermes function-calling prompt, which ``ToolCallParser`` reads back)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You are a function calling AI model. You may call one or more functions to assist with the user "
        "query. Don't make assumptions about what values to plug into functions. Here are the available "
        f"tools:\n<tools>\n{listed}\n</tools>\n"
        "For each function call, return a JSON object with the function name and arguments within "
        f"{fmt.opener}{fmt.closer} tags:\n"
        f'{fmt.opener}\n{{"name": <function-name>, "{fmt.arguments_key}": <args-json-object>}}\n{fmt.closer}'
    )
