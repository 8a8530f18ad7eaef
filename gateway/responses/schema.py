"""The wire types of OpenAI's Responses API (``POST /v1/responses``) that the gateway reads or writes, and
the request checks that need no model: which parts of a request we cannot serve or keep (a 400 naming the field
path), ``text.format`` → the chat ``response_format`` the structured-output engine compiles. ``input`` items
become chat messages in gateway/responses/input.py, tools a ``ToolPlan`` in gateway/responses/tools.py.

Requests accept unknown fields and log them, as the chat and completions models do
(gateway/schema/requests.py);
fields that are known but cannot be honored are a 400 naming them, never silently ignored. Output models
follow the SDK's ``openai.types.responses.Response`` field for field.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field

from gateway.errors import InvalidRequestError, UnsupportedParameterError
from gateway.schema.base import OpenAIRequestModel, OpenAIResponseModel
from gateway.schema.requests import RepetitionPenalty

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
    "FunctionCallItem",
    "OutputItem",
    "check_supported",
    "response_format_of",
]

#: OpenAI's bounds of ``metadata`` (the SDK's docs: 16 pairs, keys of at most 64 characters, values of 512)
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
#: ``user``: the SDK documents no bound; 256 characters, as for a session key. ``safety_identifier``: 128
MAX_USER = 256
MAX_SAFETY_IDENTIFIER = 128


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
    """A 400 naming the first part of ``req`` this server cannot serve or keep (tools are checked when they
    are planned: gateway/responses/tools.py)."""
    _check_bounds(req)
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


def _check_bounds(req: ResponseCreateRequest) -> None:
    """``metadata``, ``user`` and ``safety_identifier`` within OpenAI's bounds: they are kept with a stored
    response, so a client must not make them megabytes (the 400 does not repeat what it refuses)."""
    metadata = req.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequestError(
            f"Invalid 'metadata': too many properties. Expected an object with at most {MAX_METADATA_PAIRS} "
            f"properties, but got an object with {len(metadata)} properties instead.",
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise InvalidRequestError(
                f"Invalid 'metadata': a key is too long. Expected keys of at most {MAX_METADATA_KEY} characters, "
                f"but got one of {len(key)} characters ({key[:16]!r}…).",
                param="metadata",
            )
        if len(value) > MAX_METADATA_VALUE:
            raise InvalidRequestError(
                f"Invalid 'metadata.{key}': string too long. Expected a string with maximum length "
                f"{MAX_METADATA_VALUE}, but got a string with length {len(value)} instead.",
                param="metadata",
            )
    for name, text, limit in (
        ("user", req.user, MAX_USER),
        ("safety_identifier", req.safety_identifier, MAX_SAFETY_IDENTIFIER),
    ):
        if text is not None and len(text) > limit:
            raise InvalidRequestError(
                f"Invalid '{name}': string too long. Expected a string with maximum length {limit}, but got a "
                f"string with length {len(text)} instead.",
                param=name,
            )


def response_format_of(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` → the chat completions ``response_format`` (gateway/grammars/structured.py compiles it). The
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


class FunctionCallItem(OpenAIResponseModel):
    """A call the model made (the SDK's ``ResponseFunctionToolCall``): ``id`` names the item (``fc_…``),
    ``call_id`` the call, which a ``function_call_output`` input item answers."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    #: a JSON text, as the model wrote it
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | FunctionCallItem


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
    output: list[OutputItem] = Field(default_factory=list)
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
