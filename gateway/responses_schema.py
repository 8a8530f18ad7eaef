"""The wire types of OpenAI's Responses API (``POST /v1/responses``) that the gateway reads or writes, and
the request checks that need no model: which parts of a request we cannot serve (a 400 naming the field
path), ``input`` items → chat messages, ``text.format`` → the chat ``response_format`` the structured-output
engine compiles.

Requests accept unknown fields and log them, as the chat and completions models do (gateway/openai_schema.py);
fields that are known but cannot be honored are a 400 naming them, never silently ignored. Output models
follow the SDK's ``openai.types.responses.Response`` field for field.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field

from gateway.errors import InvalidRequestError, UnsupportedParameterError
from gateway.openai_schema import OpenAIRequestModel, OpenAIResponseModel, RepetitionPenalty

__all__ = [
    "IncompleteDetails",
    "InputTokensDetails",
    "OutputMessage",
    "OutputText",
    "OutputTokensDetails",
    "ResponseCreateRequest",
    "ResponseError",
    "ResponseObject",
    "ResponseUsage",
    "check_supported",
    "input_messages",
    "response_format_of",
]

#: tool types the Responses API defines that run on OpenAI's side (or a client's computer): never here
BUILTIN_TOOLS = (
    "web_search", "web_search_preview", "file_search", "computer_use", "computer_use_preview",
    "code_interpreter", "image_generation", "mcp", "local_shell", "shell", "apply_patch",
)  # fmt: skip
_TEXT_PARTS = ("input_text", "output_text")
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")


# ---------------------------------------------------------------------------------------------- requests


class ResponseCreateRequest(OpenAIRequestModel):
    input: str | list[dict[str, Any]] | None = None
    #: OpenAI requires it; as in chat we default to the served model when it is left out
    model: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    include: list[str] | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    prompt: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    reasoning: dict[str, Any] | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = True
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    # --- extras (vLLM-compatible sampling knobs, passed via the SDK's extra_body) ---
    seed: int | None = None
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: RepetitionPenalty | None = None


def check_supported(req: ResponseCreateRequest) -> None:
    """A 400 naming the first part of ``req`` this server cannot serve."""
    for i, tool in enumerate(req.tools or []):
        kind = tool.get("type")
        if kind == "function":
            raise UnsupportedParameterError(
                f"tools[{i}]", "is not supported on /v1/responses yet (function tools: no tool calling here)"
            )
        if isinstance(kind, str) and kind.startswith(BUILTIN_TOOLS):
            raise UnsupportedParameterError(f"tools[{i}]", f"(built-in tool '{kind}') is not supported here")
        raise UnsupportedParameterError(f"tools[{i}]", f"(tool type {kind!r}) is not supported here")
    if req.tool_choice not in (None, "none", "auto"):
        raise UnsupportedParameterError("tool_choice", "is not supported (no tools on this server)")
    if req.background:
        raise UnsupportedParameterError("background", "is not supported (responses run in the foreground)")
    if req.reasoning is not None and req.reasoning.get("effort") is not None:
        raise UnsupportedParameterError("reasoning.effort", "is not supported with this model")
    if req.reasoning is not None and req.reasoning.get("summary") is not None:
        raise UnsupportedParameterError("reasoning.summary", "is not supported with this model")
    for i, entry in enumerate(req.include or []):
        raise UnsupportedParameterError(f"include[{i}]", f"({entry!r}) cannot be produced by this server")
    if req.conversation is not None:
        raise UnsupportedParameterError("conversation", "is not supported (use previous_response_id)")
    if req.prompt is not None:
        raise UnsupportedParameterError("prompt", "(prompt templates) is not supported by this server")
    if req.top_logprobs:
        raise UnsupportedParameterError("top_logprobs", "is not supported on /v1/responses yet")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options: only allowed when stream is true.", param="stream_options")
    if req.input is None and req.previous_response_id is None:
        raise InvalidRequestError("input: Field required.", param="input")


def input_messages(req: ResponseCreateRequest) -> list[dict[str, Any]]:
    """``input`` as chat messages (``{"role", "content": str}``), ``developer`` as ``system`` (templates
    written before OpenAI renamed the role do not know it). ``instructions`` are not among them."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    if not req.input:
        raise InvalidRequestError("input: must contain at least one item.", param="input")
    return [_message(item, f"input[{i}]") for i, item in enumerate(req.input)]


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind != "message":
        raise UnsupportedParameterError(f"{where}.type", f"(input item type {kind!r}) is not supported here")
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequestError(
            f"{where}.role: expected 'user', 'system', 'developer' or 'assistant', got {role!r}.",
            param=f"{where}.role",
        )
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(_part_text(part, f"{where}.content[{j}]") for j, part in enumerate(content))
    else:
        raise InvalidRequestError(
            f"{where}.content: expected a string or a list of content parts.", param=f"{where}.content"
        )
    return {"role": "system" if role == "developer" else role, "content": text}


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


def response_format_of(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` → the chat completions ``response_format`` (gateway/structured.py compiles it). The
    Responses API flattens ``json_schema``: ``{"type", "name", "schema", "strict"}``."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("text.format: expected an object.", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise InvalidRequestError(
        f"text.format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}.", param="text.format.type"
    )


# --------------------------------------------------------------------------------------------- responses


class OutputText(OpenAIResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class InputTokensDetails(OpenAIResponseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIResponseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(OpenAIResponseModel):
    code: str
    message: str


class ResponseObject(OpenAIResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "failed", "in_progress", "incomplete"]
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    service_tier: str = "default"
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[Any] = Field(default_factory=list)
    top_logprobs: int = 0
    top_p: float = 1.0
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
