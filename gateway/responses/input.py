"""A Responses API ``input`` → chat-completions messages, the shape the chat path renders
(gateway/api/chat_messages.py) and the responses store keeps.

- ``message`` items (``type`` optional) → ``{"role", "content": str}``; ``developer`` stays ``developer``
  (chat_messages makes it ``system``); content parts ``input_text``/``output_text``/``refusal`` are joined;
- ``function_call`` items → an assistant message's ``tool_calls`` (``{"id": call_id, "type": "function",
  "function": {"name", "arguments"}}``); calls right after an assistant message join it, as one chat turn
  that says something and calls tools;
- ``function_call_output`` items → ``{"role": "tool", "tool_call_id", "content"}``; the ``call_id`` must be
  a call of the conversation (earlier turns or this input), as OpenAI requires.

Anything else is a 400 naming the item's field path.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequestError, UnsupportedParameterError

__all__ = ["called_ids", "input_messages"]

_TEXT_PARTS = ("input_text", "output_text")
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")


def called_ids(messages: list[dict[str, Any]]) -> set[str]:
    """The call ids of every tool call the assistant made in ``messages``."""
    return {c["id"] for m in messages for c in m.get("tool_calls") or ()}


def input_messages(given: str | list[dict[str, Any]] | None, calls: set[str] | None = None) -> list[dict[str, Any]]:
    """``input`` as chat messages; ``calls`` are the call ids of the turns before it (a
    ``function_call_output`` must answer one of them or a ``function_call`` of this input)."""
    if given is None:
        return []
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not given:
        raise InvalidRequestError("input: must contain at least one item.", param="input")
    known = set(calls or ())
    out: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where}: expected an input item object.", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            known.add(call["id"])
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_function_output(item, where, known))
        else:
            raise UnsupportedParameterError(f"{where}.type", f"(input item type {kind!r}) is not supported here")
    return out


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}.{key}: Field required (a string).", param=f"{where}.{key}")
    return value


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name = _string(item, "call_id", where), _string(item, "name", where)
    arguments = _string(item, "arguments", where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _function_output(item: dict[str, Any], where: str, known: set[str]) -> dict[str, Any]:
    call_id = _string(item, "call_id", where)
    if call_id not in known:
        raise InvalidRequestError(
            f"{where}.call_id: no tool call found for function call output with call_id {call_id!r}.",
            param=f"{where}.call_id",
        )
    return {"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), f"{where}.output")}


def _text(value: Any, where: str) -> str:
    """A message's ``content`` or a call output's ``output``: a string, or content parts joined by lines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(_part_text(part, f"{where}[{j}]") for j, part in enumerate(value))
    raise InvalidRequestError(f"{where}: expected a string or a list of content parts.", param=where)


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequestError(
            f"{where}.role: expected 'user', 'system', 'developer' or 'assistant', got {role!r}.",
            param=f"{where}.role",
        )
    text = _text(item.get("content"), f"{where}.content")
    return {"role": role, "content": text}


def _part_text(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise InvalidRequestError(f"{where}: expected a content part object.", param=where)
    kind = part.get("type")
    if kind in _MEDIA_PARTS:
        raise UnsupportedParameterError(where, f"('{kind}' content) is not supported: this model reads text only")
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return str(part["refusal"])
    if kind not in _TEXT_PARTS:
        raise UnsupportedParameterError(f"{where}.type", f"(content part type {kind!r}) is not supported here")
    text = part.get("text")
    if not isinstance(text, str):
        raise InvalidRequestError(f"{where}.text: Field required (a string).", param=f"{where}.text")
    return text
