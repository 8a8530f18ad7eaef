"""The OpenAI replies the gateway writes: completions and their stream chunks, usage, logprobs, errors,
models — one pydantic model per wire type, fields in the order of OpenAI's API reference. Optional fields
left ``None`` are dropped from the JSON (``drop_none``), as OpenAI's own replies omit them.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, model_serializer

from gateway.schema.base import OpenAIResponseModel, drop_none

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionMessage",
    "ChatCompletionMessageToolCall",
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
    "CompletionUsage",
    "ErrorInfo",
    "ErrorResponse",
    "FunctionCall",
    "Model",
    "ModelList",
    "PromptTokensDetails",
    "TopLogprob",
]


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
    """Extension: the request's speculative decoding (gateway/speculation/verify.py), summed over its choices."""

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
