"""OpenAI chat messages → the messages a chat template takes.

Content parts are joined into plain text; ``developer`` becomes ``system`` (templates written before
OpenAI renamed the role do not know it). Tool turns depend on the served model's ``ToolFormat``
(gateway/tools/formats.py): a template that knows tools gets assistant ``tool_calls`` (arguments as objects,
as templates expect) and ``tool`` messages as they are; one that does not gets the calls written into the
assistant's text in the syntax the gateway taught it, and each tool result as a user turn in
``<tool_response>`` tags, plus the tool instructions in the system message.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import InvalidRequestError
from gateway.schema.requests import ChatCompletionMessageParam, ToolCallParam
from gateway.tools.formats import ToolFormat, format_call_json, tool_call_id
from gateway.tools.plan import ToolPlan, tool_instructions

__all__ = ["chat_messages", "with_instructions"]


def chat_messages(
    messages: list[ChatCompletionMessageParam], fmt: ToolFormat, plan: ToolPlan | None
) -> list[dict[str, Any]]:
    """Validated messages for ``apply_chat_template`` (a 400 naming the field otherwise)."""
    if not messages:
        raise InvalidRequestError("messages: must contain at least one message.", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        text = _text(m, i)
        if m.role == "tool":
            out.append(_tool_result(m, i, text, fmt))
            continue
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequestError(
                f"messages[{i}].tool_calls: only assistant messages make tool calls.", param=f"messages[{i}].tool_calls"
            )
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            if fmt.native:
                message["tool_calls"] = [_native_call(c, fmt) for c in m.tool_calls]
            else:
                calls = "\n".join(_written_call(c, fmt) for c in m.tool_calls)
                message["content"] = f"{text}\n{calls}" if text else calls
        out.append(message)
    if plan is not None and not fmt.native:
        out = with_instructions(out, tool_instructions(plan.tools, fmt))
    return out


def _text(m: ChatCompletionMessageParam, i: int) -> str:
    if m.content is None:
        if m.role != "assistant":
            raise InvalidRequestError(f"messages[{i}].content: Field required", param=f"messages[{i}].content")
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for j, part in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if part.type != "text":
            raise InvalidRequestError(
                f"{where}.type: only 'text' content parts are supported, got '{part.type}'.", param=f"{where}.type"
            )
        if part.text is None:
            raise InvalidRequestError(f"{where}.text: Field required", param=f"{where}.text")
        parts.append(part.text)
    return "\n".join(parts)


def _tool_result(m: ChatCompletionMessageParam, i: int, text: str, fmt: ToolFormat) -> dict[str, Any]:
    if not m.tool_call_id:
        raise InvalidRequestError(
            f"messages[{i}].tool_call_id: Field required (the id of the call this answers).",
            param=f"messages[{i}].tool_call_id",
        )
    if not fmt.native:
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    message: dict[str, Any] = {"role": "tool", "content": text, "tool_call_id": tool_call_id(fmt, m.tool_call_id)}
    if m.name is not None:
        message["name"] = m.name
    return message


def _arguments(call: ToolCallParam) -> Any:
    """A call's arguments as an object (templates write them with ``tojson``); text that is no JSON stays."""
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


def _native_call(call: ToolCallParam, fmt: ToolFormat) -> dict[str, Any]:
    return {
        "id": tool_call_id(fmt, call.id),
        "type": "function",
        "function": {"name": call.function.name, "arguments": _arguments(call)},
    }


def _written_call(call: ToolCallParam, fmt: ToolFormat) -> str:
    return f"{fmt.opener}\n{format_call_json(call.function.name, _arguments(call), fmt)}\n{fmt.closer}"


def with_instructions(messages: list[dict[str, Any]], instructions: str) -> list[dict[str, Any]]:
    """The tool instructions after the first system message's text, or as a system message of their own."""
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{instructions}" if first["content"] else instructions
        return [first, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]
