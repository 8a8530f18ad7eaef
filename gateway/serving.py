"""OpenAI requests → engine choices → OpenAI responses, for /v1/chat/completions and /v1/completions.

Everything that can be checked before generation is checked here, so a bad request is a 400 (a missing
swarm a 503) before any stream starts; parameters we cannot honor are a 400 naming them.

Session affinity: the ``X-Session-Id`` header, else the ``user`` field, names the conversation whose cached
session the request resumes (without either, the engine matches the prompt's prefix); the prompt tokens it
did not have to send are reported as ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar, cast

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gateway.choices import ChoiceResult, ChoiceSpec, Delta
from gateway.engine import Engine
from gateway.errors import InvalidRequestError, UnsupportedParameterError
from gateway.logprobs import LegacyLogprobs, chat_logprobs
from gateway.openai_schema import (
    ChatCompletion,
    ChatCompletionMessage,
    ChatCompletionRequest,
    Choice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    CompletionUsage,
    PromptTokensDetails,
)
from gateway.sampling import SamplingParams, choice_seed
from gateway.streaming import ChatChunkBuilder, ChunkBuilder, CompletionChunkBuilder, event_stream

__all__ = ["create_chat_completion", "create_completion"]

T = TypeVar("T")

#: HTTP 499: nginx's "client closed request" — nobody reads it, but logs and metrics do
_CLIENT_CLOSED = 499
#: names the conversation whose cached session a request continues (else the ``user`` field does)
SESSION_HEADER = "x-session-id"


async def create_chat_completion(engine: Engine, req: ChatCompletionRequest, request: Request) -> Response:
    engine.check_model(req.model)
    _reject_unsupported_chat(req)
    messages = _chat_messages(req)
    n = _choices(engine, req.n, 1)
    _check_stream_options(req.stream, req.stream_options)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")
    top_k = (req.top_logprobs or 0) if req.logprobs else None

    prompt = engine.render_chat(messages)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = engine.max_tokens_for(len(prompt), requested, param="messages")
    stop = _stop_list(req.stop)
    grammar = await engine.structured.compile(req.response_format)  # structured outputs (a 400 if bad)
    specs = [
        ChoiceSpec(i, prompt, max_tokens, _sampling(engine, req, choice_seed(req.seed, i), grammar), stop, top_k)
        for i in range(n)
    ]
    model = engine.model_id
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    generation = await engine.start(specs, _session_key(request, req.user))

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        builder = ChatChunkBuilder(
            id=completion_id,
            model=model,
            prompt_tokens=len(prompt),
            include_usage=include_usage,
            n=n,
            vocab=engine.vocab,
            logprobs=top_k is not None,
        )
        return event_stream(generation, _CachedTokensUsage(builder))

    results = await _cancel_on_disconnect(request, generation.collect())
    if results is None:
        return Response(status_code=_CLIENT_CLOSED)
    response = ChatCompletion(
        id=completion_id,
        choices=[
            Choice(
                finish_reason=r.finish_reason,
                index=r.index,
                logprobs=chat_logprobs(engine.vocab, r.logprobs) if top_k is not None else None,
                message=ChatCompletionMessage(content=r.text),
            )
            for r in results
        ],
        model=model,
        usage=_usage(len(prompt), results),
    )
    return JSONResponse(response.model_dump(mode="json"))


async def create_completion(engine: Engine, req: CompletionRequest, request: Request) -> Response:
    engine.check_model(req.model)
    if req.suffix is not None:
        raise UnsupportedParameterError("suffix", "is not supported by this model")
    if req.best_of is not None and req.best_of != 1:
        raise UnsupportedParameterError("best_of", "is not supported (only best_of=1)")
    if req.echo and req.stream:
        raise UnsupportedParameterError("echo", "is not supported together with stream")
    _check_stream_options(req.stream, req.stream_options)
    prompts = _completion_prompts(engine, req.prompt)
    n = req.n or 1
    _choices(engine, n, len(prompts))
    stop = _stop_list(req.stop)
    k = req.logprobs
    grammar = await engine.structured.compile(req.response_format)

    specs: list[ChoiceSpec] = []
    for p, (ids, _) in enumerate(prompts):
        max_tokens = engine.max_tokens_for(len(ids), req.max_tokens, param="prompt")
        for j in range(n):
            index = p * n + j
            sampling = _sampling(engine, req, choice_seed(req.seed, index), grammar)
            specs.append(
                ChoiceSpec(
                    index,
                    ids,
                    max_tokens,
                    sampling,
                    stop,
                    k,
                    prompt_logprobs=bool(req.echo) and k is not None,
                )
            )
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    model = engine.model_id
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    generation = await engine.start(specs, _session_key(request, req.user))

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        builder = CompletionChunkBuilder(
            id=completion_id,
            model=model,
            prompt_tokens=prompt_tokens,
            include_usage=include_usage,
            vocab=engine.vocab,
            logprobs=k is not None,
        )
        return event_stream(generation, _CachedTokensUsage(builder))

    results = await _cancel_on_disconnect(request, generation.collect())
    if results is None:
        return Response(status_code=_CLIENT_CLOSED)
    choices = []
    for r in results:
        echo_text = prompts[r.index // n][1] if req.echo else ""
        logprobs = None
        if k is not None:
            legacy = LegacyLogprobs(engine.vocab)
            lps = (r.prompt_logprobs or []) + r.logprobs if req.echo else r.logprobs
            logprobs = legacy.build(lps)
        choices.append(
            CompletionChoice(
                finish_reason=r.finish_reason, index=r.index, logprobs=logprobs, text=echo_text + r.text
            )
        )
    response = Completion(
        id=completion_id, choices=choices, model=model, usage=_usage(prompt_tokens, results)
    )
    return JSONResponse(response.model_dump(mode="json"))


# -------------------------------------------------------------------------------------------- the checks


def _reject_unsupported_chat(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise UnsupportedParameterError("tools", "is not supported yet (no tool calling on this server)")
    if req.tool_choice not in (None, "none"):
        raise UnsupportedParameterError(
            "tool_choice", "is not supported yet (no tool calling on this server)"
        )
    if req.functions:
        raise UnsupportedParameterError("functions", "is not supported (no function calling on this server)")
    if req.function_call not in (None, "none"):
        raise UnsupportedParameterError(
            "function_call", "is not supported (no function calling on this server)"
        )
    if req.audio is not None:
        raise UnsupportedParameterError("audio", "is not supported by this model")
    if req.modalities is not None and req.modalities != ["text"]:
        raise UnsupportedParameterError("modalities", "supports only ['text'] on this model")
    if req.prediction is not None:
        raise UnsupportedParameterError("prediction", "is not supported by this server")
    if req.reasoning_effort is not None:
        raise UnsupportedParameterError("reasoning_effort", "is not supported with this model")


def _chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Validated messages as the chat template wants them: plain-string content, ``developer`` as ``system``
    (templates written before OpenAI renamed the role do not know it)."""
    if not req.messages:
        raise InvalidRequestError("messages: must contain at least one message.", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        if m.content is None:
            if m.role != "assistant":
                raise InvalidRequestError(
                    f"messages[{i}].content: Field required", param=f"messages[{i}].content"
                )
            text = ""
        elif isinstance(m.content, str):
            text = m.content
        else:
            parts = []
            for j, part in enumerate(m.content):
                where = f"messages[{i}].content[{j}]"
                if part.type != "text":
                    raise InvalidRequestError(
                        f"{where}.type: only 'text' content parts are supported, got '{part.type}'.",
                        param=f"{where}.type",
                    )
                if part.text is None:
                    raise InvalidRequestError(f"{where}.text: Field required", param=f"{where}.text")
                parts.append(part.text)
            text = "\n".join(parts)
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def _completion_prompts(
    engine: Engine, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[tuple[list[int], str]]:
    """Every accepted shape of ``prompt`` → ``[(token ids, text to echo)]``."""
    # isinstance cannot narrow a union of list types by their items: the casts say what the checks found
    items: list[str | list[int]]
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        items = [cast(list[int], list(prompt))]
    else:  # pydantic validated the union: every item is a string, or every item a list of token ids
        items = cast(list[str | list[int]], list(prompt))
    if not items:
        raise InvalidRequestError("prompt: must not be empty.", param="prompt")
    out = []
    vocab = engine.vocab_size
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            ids, text = engine.encode(item), item
        else:
            bad = [t for t in item if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"{where}: token id {bad[0]} is out of range [0, {vocab}).", param=where
                )
            ids, text = item, engine.decode(item)
        if not ids:
            raise InvalidRequestError(f"{where}: must not be empty.", param=where)
        out.append((ids, text))
    return out


def _choices(engine: Engine, n: int | None, prompts: int) -> int:
    n = n or 1
    limit = engine.settings.max_choices
    if n * prompts > limit:
        raise InvalidRequestError(
            f"n: at most {limit} choices per request (asked for {n * prompts}).", param="n"
        )
    return n


def _check_stream_options(stream: bool | None, stream_options: object) -> None:
    if stream_options is not None and not stream:
        raise InvalidRequestError("stream_options: only allowed when stream is true.", param="stream_options")


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def _sampling(
    engine: Engine, req: ChatCompletionRequest | CompletionRequest, seed: int | None, constraint: Any = None
) -> SamplingParams:
    top_k = req.top_k if req.top_k is not None else 0
    if top_k < -1:
        raise InvalidRequestError("top_k: must be -1 (off), 0 (off) or a positive integer.", param="top_k")
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(top_k, 0),
        min_p=req.min_p or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        logit_bias=_logit_bias(engine, req.logit_bias),
        seed=seed,
        constraint=constraint,
    )


def _logit_bias(engine: Engine, bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``{"token id as string": bias in [-100, 100]}``."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias: key {key!r} is not a token id.", param="logit_bias"
            ) from None
        if not 0 <= token < engine.vocab_size:
            raise InvalidRequestError(f"logit_bias: token id {token} is out of range.", param="logit_bias")
        if not -100 <= value <= 100:
            raise InvalidRequestError(f"logit_bias: bias {value} is outside [-100, 100].", param="logit_bias")
        out[token] = float(value)
    return out


def _session_key(request: Request, user: str | None) -> str | None:
    return request.headers.get(SESSION_HEADER) or user or None


def _usage(prompt_tokens: int, results: list[ChoiceResult]) -> CompletionUsage:
    completion = sum(r.completion_tokens for r in results)
    return CompletionUsage(
        completion_tokens=completion,
        prompt_tokens=prompt_tokens,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(r.cached_tokens for r in results)),
    )


class _CachedTokensUsage:
    """A ``ChunkBuilder`` whose usage frame also reports ``prompt_tokens_details.cached_tokens`` (the
    builders in gateway/streaming.py count completion tokens only)."""

    def __init__(self, inner: ChunkBuilder):
        self.inner = inner
        self.cached: dict[int, int] = {}

    def opening(self) -> list[str]:
        return self.inner.opening()

    def frames(self, delta: Delta) -> list[str]:
        self.cached[delta.index] = delta.cached_tokens
        return self.inner.frames(delta)

    def usage(self) -> str | None:
        frame = self.inner.usage()
        cached = sum(self.cached.values())
        if frame is None or not cached:
            return frame
        chunk = json.loads(frame)
        chunk["usage"]["prompt_tokens_details"] = PromptTokensDetails(cached_tokens=cached).model_dump()
        return json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)


async def _cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``; if the client disconnects first, cancel it (its sessions close in ``finally``) and
    return None. Starlette does not cancel a handler when the client leaves, so we watch for it."""
    result: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch)
        try:
            result.append(await work)
        except Exception as exc:  # re-raised below, unwrapped by the task group's ExceptionGroup
            failure.append(exc)
        tg.cancel_scope.cancel()
    if failure:
        raise failure[0]
    return result[0] if result else None
