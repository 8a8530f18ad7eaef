"""One pydantic model per OpenAI wire type the gateway reads or writes.

Fields follow the order of OpenAI's API reference. Request models accept unknown fields and log them
(as vLLM does) so newer SDKs keep working; the extras we do honor (``top_k``, ``min_p``,
``repetition_penalty``) are fenced at the end of each request model. Parameters that are known but cannot be
honored are rejected by ``serving`` with a 400 naming them, never silently ignored.

Requests are validated in strict mode (``parse_request``): ``"5"`` is not an integer, ``2.0`` is not ``n``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

from gateway.errors import InvalidRequestError, validation_error

logger = logging.getLogger(__name__)

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionContentPart",
    "ChatCompletionMessage",
    "ChatCompletionMessageParam",
    "ChatCompletionRequest",
    "ChatCompletionTokenLogprob",
    "Choice",
    "ChoiceDelta",
    "ChoiceLogprobs",
    "ChunkChoice",
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionUsage",
    "ErrorInfo",
    "ErrorResponse",
    "Model",
    "ModelList",
    "PromptTokensDetails",
    "StreamOptions",
    "TopLogprob",
    "parse_request",
]


class OpenAIRequestModel(BaseModel):
    """Base of request models: unknown fields are kept and logged, not rejected."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="wrap")
    @classmethod
    def _log_extra_fields(cls, data: Any, handler: Any) -> Any:
        result = handler(data)
        if isinstance(data, dict):
            known = set(cls.model_fields)
            known.update(f.alias for f in cls.model_fields.values() if f.alias)
            extra = sorted(set(data) - known)
            if extra:
                logger.warning("%s: ignoring unknown fields %s", cls.__name__, extra)
        return result


class OpenAIResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


RequestT = TypeVar("RequestT", bound=OpenAIRequestModel)


def parse_request(model_cls: type[RequestT], body: bytes) -> RequestT:
    """Body bytes → request model; malformed JSON, a non-object or a bad field is a 400 naming the param."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(
            f"We could not parse the JSON body of your request ({exc}). "
            "The OpenAI API expects a JSON payload."
        ) from None
    if not isinstance(data, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    try:
        return model_cls.model_validate(data, strict=True)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None


# ---------------------------------------------------------------------------------------------- requests

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
StopParam = str | Annotated[list[str], Field(max_length=4)]


class StreamOptions(OpenAIRequestModel):
    include_usage: bool | None = None


class ChatCompletionContentPart(OpenAIRequestModel):
    """Any content part; ``serving`` accepts only ``type == "text"`` and names the others in a 400."""

    type: str
    text: str | None = None


class ChatCompletionMessageParam(OpenAIRequestModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ChatCompletionContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(OpenAIRequestModel):
    messages: list[ChatCompletionMessageParam]
    #: OpenAI requires it; like vLLM we default to the served model when it is left out
    model: str | None = None
    audio: dict[str, Any] | None = None
    frequency_penalty: Penalty | None = 0.0
    function_call: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    n: Annotated[int, Field(ge=1)] | None = 1
    parallel_tool_calls: bool | None = None
    prediction: dict[str, Any] | None = None
    presence_penalty: Penalty | None = 0.0
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None
    seed: int | None = None
    service_tier: str | None = None
    stop: StopParam | None = None
    store: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = 1.0
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = 1.0
    user: str | None = None
    # --- extras (vLLM-compatible sampling knobs, passed via the SDK's extra_body) ---
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None


class CompletionRequest(OpenAIRequestModel):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: Annotated[int, Field(ge=1)] | None = None
    echo: bool | None = False
    frequency_penalty: Penalty | None = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1)] | None = 1
    presence_penalty: Penalty | None = 0.0
    seed: int | None = None
    stop: StopParam | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = 1.0
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = 1.0
    user: str | None = None
    # --- extras ---
    #: as in chat (vLLM accepts it here too): ``json_object`` / ``json_schema`` constrain the text
    response_format: dict[str, Any] | None = None
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None


# --------------------------------------------------------------------------------------------- responses


class ErrorInfo(OpenAIResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIResponseModel):
    error: ErrorInfo


class PromptTokensDetails(OpenAIResponseModel):
    cached_tokens: int = 0


class CompletionUsage(OpenAIResponseModel):
    completion_tokens: int
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(OpenAIResponseModel):
    token: str
    bytes: list[int] | None
    logprob: float


class ChatCompletionTokenLogprob(OpenAIResponseModel):
    token: str
    bytes: list[int] | None
    logprob: float
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(OpenAIResponseModel):
    content: list[ChatCompletionTokenLogprob] | None
    refusal: list[ChatCompletionTokenLogprob] | None = None


class ChatCompletionMessage(OpenAIResponseModel):
    content: str | None
    refusal: str | None = None
    role: Literal["assistant"] = "assistant"


class Choice(OpenAIResponseModel):
    finish_reason: Literal["stop", "length"]
    index: int
    logprobs: ChoiceLogprobs | None = None
    message: ChatCompletionMessage


class ChatCompletion(OpenAIResponseModel):
    id: str
    choices: list[Choice]
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None
    usage: CompletionUsage | None = None


class ChoiceDelta(OpenAIResponseModel):
    """A stream delta; unset fields are left out of the JSON (``{}`` on the finishing chunk)."""

    content: str | None = None
    refusal: str | None = None
    role: Literal["assistant"] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChunkChoice(OpenAIResponseModel):
    delta: ChoiceDelta
    finish_reason: Literal["stop", "length"] | None = None
    index: int
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(OpenAIResponseModel):
    id: str
    choices: list[ChunkChoice]
    created: int
    model: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str | None = None
    usage: CompletionUsage | None = None


class CompletionLogprobs(OpenAIResponseModel):
    """The legacy completions format: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIResponseModel):
    finish_reason: Literal["stop", "length"] | None
    index: int
    logprobs: CompletionLogprobs | None = None
    text: str


class Completion(OpenAIResponseModel):
    id: str
    choices: list[CompletionChoice]
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: str | None = None
    usage: CompletionUsage | None = None


#: a streamed completion chunk has the same shape as a completion
CompletionChunk = Completion


class Model(OpenAIResponseModel):
    id: str
    created: int
    object: Literal["model"] = "model"
    owned_by: str = "swarmserve"


class ModelList(OpenAIResponseModel):
    object: Literal["list"] = "list"
    data: list[Model]
