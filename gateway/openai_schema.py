"""One pydantic model per OpenAI wire type the gateway reads or writes.

Fields follow the order of OpenAI's API reference. Request models accept unknown fields and log them
(as vLLM does) so newer SDKs keep working; the extras we do honor (``top_k``, ``min_p``,
``repetition_penalty``) are fenced at the end of each request model. Parameters that are known but cannot be
honored are rejected by ``serving`` with a 400 naming them, never silently ignored.

Requests are validated in strict mode (``parse_request``): ``"5"`` is not an integer, ``2.0`` is not ``n``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field, model_serializer

from gateway.schema_base import OpenAIRequestModel, OpenAIResponseModel, drop_none, parse_request

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionContentPart",
    "ChatCompletionMessage",
    "ChatCompletionMessageParam",
    "ChatCompletionMessageToolCall",
    "ChatCompletionToolParam",
    "ChatCompletionRequest",
    "ChatCompletionTokenLogprob",
    "Choice",
    "ChoiceDelta",
    "ChoiceDeltaFunctionCall",
    "ChoiceDeltaToolCall",
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
    "FunctionCall",
    "FunctionCallParam",
    "FunctionDefinition",
    "Model",
    "ModelList",
    "OpenAIRequestModel",
    "OpenAIResponseModel",
    "PromptTokensDetails",
    "RepetitionPenalty",
    "StreamOptions",
    "ToolCallParam",
    "TopLogprob",
    "parse_request",
]


# ---------------------------------------------------------------------------------------------- requests

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
StopParam = str | Annotated[list[str], Field(max_length=4)]
#: vLLM's knob; bounded so that dividing or multiplying logits by it cannot overflow them into NaNs
RepetitionPenalty = Annotated[float, Field(ge=0.01, le=100.0)]


class StreamOptions(OpenAIRequestModel):
    include_usage: bool | None = None


class ChatCompletionContentPart(OpenAIRequestModel):
    """Any content part; ``serving`` accepts only ``type == "text"`` and names the others in a 400."""

    type: str
    text: str | None = None


class FunctionCallParam(OpenAIRequestModel):
    name: str
    #: a JSON text, as the model wrote it
    arguments: str


class ToolCallParam(OpenAIRequestModel):
    """A call an earlier assistant turn made (``messages[i].tool_calls[j]``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatCompletionMessageParam(OpenAIRequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatCompletionContentPart] | None = None
    name: str | None = None
    #: assistant turns: the calls it made
    tool_calls: list[ToolCallParam] | None = None
    #: tool turns: the call this is the result of
    tool_call_id: str | None = None


class FunctionDefinition(OpenAIRequestModel):
    name: str
    description: str | None = None
    #: a JSON schema of the arguments object (None: any object)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolParam(OpenAIRequestModel):
    type: Literal["function"]
    function: FunctionDefinition


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
    tools: Annotated[list[ChatCompletionToolParam], Field(max_length=128)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = 1.0
    user: str | None = None
    # --- extras (vLLM-compatible sampling knobs, passed via the SDK's extra_body) ---
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: RepetitionPenalty | None = None
    #: speculative decoding: auto (the gateway's setting), off, prompt_lookup, draft_model
    speculation: Literal["auto", "off", "prompt_lookup", "draft_model"] | None = None


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
    repetition_penalty: RepetitionPenalty | None = None
    #: speculative decoding: auto (the gateway's setting), off, prompt_lookup, draft_model
    speculation: Literal["auto", "off", "prompt_lookup", "draft_model"] | None = None


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


class CompletionTokensDetails(OpenAIResponseModel):
    #: guessed tokens (speculative decoding, ``prediction`` content) that the output kept / did not keep
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class SpeculationUsage(OpenAIResponseModel):
    """Extension: the request's speculative decoding (gateway/speculation.py), summed over its choices."""

    #: the drafter(s) used: prompt_lookup, draft_model
    drafter: str
    drafted_tokens: int
    accepted_tokens: int
    #: decode steps (trips along the chain) that carried guesses
    steps: int


class CompletionUsage(OpenAIResponseModel):
    completion_tokens: int
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    #: only when the request's choices decoded speculatively
    completion_tokens_details: CompletionTokensDetails | None = None
    speculation: SpeculationUsage | None = None

    @model_serializer(mode="wrap")
    def _drop_no_speculation(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for key in ("completion_tokens_details", "speculation"):
            if out.get(key) is None:
                out.pop(key, None)  # the keys only when guesses were made
        return out


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


class FunctionCall(OpenAIResponseModel):
    name: str
    arguments: str


class ChatCompletionMessageToolCall(OpenAIResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatCompletionMessage(OpenAIResponseModel):
    content: str | None
    refusal: str | None = None
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ChatCompletionMessageToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)  # as OpenAI: the key only when the model called a tool
        return out


#: why a choice ended; ``tool_calls`` when it ended by calling tools
FinishReasonLiteral = Literal["stop", "length", "tool_calls"]


class Choice(OpenAIResponseModel):
    finish_reason: FinishReasonLiteral
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


class ChoiceDeltaFunctionCall(OpenAIResponseModel):
    """Set fields only: ``name`` on a call's first delta, ``arguments`` pieces after it."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return drop_none(handler(self))


class ChoiceDeltaToolCall(OpenAIResponseModel):
    """A piece of a streamed call: ``id``, ``type`` and the name on its first piece only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ChoiceDeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return drop_none(handler(self))


class ChoiceDelta(OpenAIResponseModel):
    """A stream delta; unset fields are left out of the JSON (``{}`` on the finishing chunk)."""

    content: str | None = None
    refusal: str | None = None
    role: Literal["assistant"] | None = None
    tool_calls: list[ChoiceDeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return drop_none(handler(self))


class ChunkChoice(OpenAIResponseModel):
    delta: ChoiceDelta
    finish_reason: FinishReasonLiteral | None = None
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
    # extras, as vLLM lists LoRA models: the base model (``root``), and for an adapter the model it adapts
    root: str | None = None
    parent: str | None = None


class ModelList(OpenAIResponseModel):
    object: Literal["list"] = "list"
    data: list[Model]
