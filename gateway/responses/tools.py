"""Function tools on ``/v1/responses``, through the chat path's tool machinery (gateway/tools/plan.py and
its grammar and parser): a small adapter, not a second implementation.

The Responses API writes a function tool flat (``{"type": "function", "name", "description", "parameters",
"strict"}``) and a named choice as ``{"type": "function", "name"}``; chat nests both under ``function``.
``plan_response_tools`` translates them and asks ``plan_tools`` for the ``ToolPlan`` (a 400 names the
Responses field path, ``tools[i].name`` rather than chat's ``tools[i].function.name``). Built-in tools
(``web_search``, ``file_search``, ``computer_use``…) run on OpenAI's side: a 400 naming the tool type.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from gateway.errors import InvalidRequestError, UnsupportedParameterError
from gateway.schema.requests import ChatCompletionRequest, ChatCompletionToolParam
from gateway.tools.formats import ToolFormat
from gateway.tools.plan import ToolPlan, plan_tools

__all__ = ["BUILTIN_TOOLS", "MAX_TOOLS", "plan_response_tools"]

#: tool types the Responses API defines that run on OpenAI's side (or a client's computer): never here
BUILTIN_TOOLS = (
    "web_search", "web_search_preview", "file_search", "computer_use", "computer_use_preview",
    "code_interpreter", "image_generation", "mcp", "local_shell", "shell", "apply_patch", "tool_search",
)  # fmt: skip
#: as chat completions: the most tools one request may offer
MAX_TOOLS = 128
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
_CHAT_PATH = re.compile(r"tools\[(\d+)\]\.function\.")


def plan_response_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    fmt: ToolFormat,
) -> ToolPlan | None:
    """The request's tools as the chat path plans them (None: no tool in play), or a 400 naming the field."""
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}.", param="tools")
    chat_tools = [_chat_tool(tool, i) for i, tool in enumerate(tools)]
    request = ChatCompletionRequest.model_construct(
        messages=[], tools=chat_tools, tool_choice=_chat_choice(tool_choice), parallel_tool_calls=parallel_tool_calls
    )
    try:
        return plan_tools(request, fmt)
    except InvalidRequestError as exc:  # it names chat's field paths; say the Responses API's
        exc.message = _CHAT_PATH.sub(r"tools[\1].", exc.message)
        exc.param = _CHAT_PATH.sub(r"tools[\1].", exc.param) if exc.param else exc.param
        raise


def _chat_tool(tool: Any, i: int) -> ChatCompletionToolParam:
    where = f"tools[{i}]"
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        if isinstance(kind, str) and kind.startswith(BUILTIN_TOOLS):
            raise UnsupportedParameterError(where, f"(built-in tool '{kind}') is not supported here")
        raise UnsupportedParameterError(where, f"(tool type {kind!r}) is not supported here")
    if not isinstance(tool.get("name"), str):
        raise InvalidRequestError(f"{where}.name: Field required (a string).", param=f"{where}.name")
    function = {k: tool[k] for k in _FUNCTION_KEYS if tool.get(k) is not None}
    try:
        return ChatCompletionToolParam.model_validate({"type": "function", "function": function})
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"]
        field = f"{where}.{loc[1]}" if len(loc) > 1 else where
        raise InvalidRequestError(f"{field}: {exc.errors()[0]['msg']}.", param=field) from None


def _chat_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``{"type": "function", "name"}`` → chat's ``{"type": "function", "function": {"name"}}``; a hosted
    tool's choice is a 400; strings and ``allowed_tools`` go to ``plan_tools`` as they are."""
    if not isinstance(choice, dict):
        return choice
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise InvalidRequestError(
                "tool_choice: a named choice is {'type': 'function', 'name': ...}.", param="tool_choice"
            )
        return {"type": "function", "function": {"name": name}}
    if kind == "allowed_tools":
        return choice
    raise UnsupportedParameterError("tool_choice", f"(tool choice type {kind!r}) is not supported here")
