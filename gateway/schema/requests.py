"""The OpenAI requests the gateway reads (chat completions, completions): one pydantic model per wire type.
What it writes is in gateway/schema/replies.py; the base classes and the strict parser in schema_base.py.

Fields follow the order of OpenAI's API reference. Request models accept unknown fields and log them
(as vLLM does) so newer SDKs keep working; the extras we do honor (``top_k``, ``min_p``,
``repetition_penalty``) are fenced at the end of each request model. Parameters that are known but cannot be
honored are rejected by ``serving`` with a 400 naming them, never silently ignored.

Requests are validated in strict mode (``parse_request``): ``"5"`` is not an integer, ``2.0`` is not ``n``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from gateway.schema.base import OpenAIRequestModel

__all__ = [
    "ChatCompletionContentPart",
    "ChatCompletionMessageParam",
    "ChatCompletionRequest",
    "ChatCompletionToolParam",
    "CompletionRequest",
    "FunctionCallParam",
    "FunctionDefinition",
    "RepetitionPenalty",
    "StreamOptions",
    "ToolCallParam",
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
