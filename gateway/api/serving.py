"""OpenAI requests → engine choices → OpenAI responses, for /v1/chat/completions and /v1/completions.

Everything that can be checked before generation is checked here, so a bad request is a 400 (a missing
swarm a 503) before any stream starts; parameters we cannot honor are a 400 naming them.

Session affinity: the ``X-Session-Id`` header, else the ``user`` field, names the conversation whose cached
session the request resumes (without either, the engine matches the prompt's prefix); the prompt tokens it
did not have to send are reported as ``usage.prompt_tokens_details.cached_tokens``. A chat request that
is a one-off (a chat UI's title, tags or follow-up request: gateway/affinity/one_off.py) neither resumes nor
keeps a session.
"""

from __future__ import annotations

import uuid
from typing import Any, cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gateway.admission.stream_slots import hold_choices
from gateway.affinity.one_off import is_one_off
from gateway.api.chat_messages import chat_messages
from gateway.api.logprobs import LegacyLogprobs, chat_logprobs
from gateway.api.request_parts import (
    CLIENT_CLOSED,
    CachedTokensUsage,
    admission_need,
    cache_owner,
    cancel_on_disconnect,
    check_stream_options,
    count_choices,
    ignored_fields,
    prediction_text,
    sampling_params,
    session_key,
    stop_list,
    usage_of,
)
from gateway.api.route_info import RouteInfo
from gateway.api.streaming import ChatChunkBuilder, CompletionChunkBuilder, event_stream
from gateway.api.tool_share import naming_tool_share
from gateway.decode.capacity_queue import NEED
from gateway.decode.choices import ChoiceResult, ChoiceSpec
from gateway.decode.engine import Engine
from gateway.decode.sampling import choice_seed
from gateway.errors import InvalidRequestError, UnsupportedParameterError
from gateway.schema.replies import (
    ChatCompletion,
    ChatCompletionMessage,
    ChatCompletionMessageToolCall,
    Choice,
    Completion,
    CompletionChoice,
    FunctionCall,
)
from gateway.schema.requests import ChatCompletionRequest, CompletionRequest
from gateway.tools.grammar import tool_call_grammar
from gateway.tools.parser import parse_tool_calls
from gateway.tools.plan import ToolPlan, plan_tools

__all__ = ["chat_grammar", "create_chat_completion", "create_completion"]


async def create_chat_completion(engine: Engine, req: ChatCompletionRequest, request: Request) -> Response:
    served = await engine.select_model(req.model)  # the base model or a LoRA adapter (a 404 if neither)
    _reject_unsupported_chat(req)
    fmt = engine.tool_format
    tools = plan_tools(req, fmt)  # None: no tool in play
    messages = chat_messages(req.messages, fmt, tools)
    n = count_choices(engine, req.n, 1)
    await hold_choices(request, n)  # a stream slot per choice (gateway/admission/stream_slots.py)
    check_stream_options(req.stream, req.stream_options)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")
    top_k = (req.top_logprobs or 0) if req.logprobs else None

    # the tokenize thread (gateway/decode/tokenize_thread.py): a prompt of megabytes must not hold the event loop
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    native_tools = tools.tools if tools is not None and fmt.native else None
    async with naming_tool_share(engine, tools):  # a prompt too long: how much of it is tools, in the 400
        prompt = await engine.render_chat(messages, native_tools, requested=requested)
        max_tokens = engine.max_tokens_for(len(prompt), requested, param="messages")
    stop = stop_list(req.stop) + (tools.stop if tools is not None else [])
    grammar = await chat_grammar(engine, req, tools)
    keep_special = tools is not None and await engine.special_token_id(fmt.opener or "<|python_tag|>") is not None
    engine.speculators.check(req.speculation)
    reference = await engine.prediction_ids(prediction_text(req.prediction))
    specs = [
        ChoiceSpec(
            i,
            prompt,
            max_tokens,
            sampling_params(engine, req, choice_seed(req.seed, i), grammar),
            stop,
            top_k,
            keep_special_tokens=keep_special,
            speculation=req.speculation or "auto",
            reference_ids=reference,
            adapter=served.adapter,
        )
        for i in range(n)
    ]
    model = served.id
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    async with naming_tool_share(engine, tools):
        NEED.set(admission_need(engine, specs))  # a 400 if the swarm could never hold it; else reserved
    key = session_key(request, req.user)
    # a chat UI's background request (title, tags, follow-ups) is not kept: it would evict the conversation's cache
    generation = await engine.start(specs, key, cache_owner(request), keep=not is_one_off(req, key))
    route = RouteInfo.of(generation, engine.backend)  # x-swarm-route etc. (gateway/api/route_info.py)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        builder = ChatChunkBuilder(
            id=completion_id,
            model=model,
            prompt_tokens=len(prompt),
            include_usage=include_usage,
            system_fingerprint=engine.system_fingerprint,
            n=n,
            vocab=engine.vocab,
            logprobs=top_k is not None,
            tools=tools,
        )
        return _streamed(generation, builder, route, req)

    results = await cancel_on_disconnect(request, generation.collect())
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    response = ChatCompletion(
        id=completion_id,
        choices=[
            Choice(
                finish_reason=finish,
                index=r.index,
                logprobs=chat_logprobs(engine.vocab, r.logprobs) if top_k is not None else None,
                message=message,
            )
            for r in results
            for message, finish in [_reply(r, tools)]
        ],
        model=model,
        system_fingerprint=engine.system_fingerprint,
        usage=usage_of(len(prompt), results),
    )
    return _answered(response, route, req)


async def create_completion(engine: Engine, req: CompletionRequest, request: Request) -> Response:
    served = await engine.select_model(req.model)  # the base model or a LoRA adapter (a 404 if neither)
    if req.suffix is not None:
        raise UnsupportedParameterError("suffix", "is not supported by this model")
    if req.best_of is not None and req.best_of != 1:
        raise UnsupportedParameterError("best_of", "is not supported (only best_of=1)")
    if req.echo and req.stream:
        raise UnsupportedParameterError("echo", "is not supported together with stream")
    check_stream_options(req.stream, req.stream_options)
    prompts = await engine.tokenize.run(_completion_prompts, engine, req.prompt, req.max_tokens)  # off the event loop
    n = req.n or 1
    count_choices(engine, n, len(prompts))
    await hold_choices(request, n * len(prompts))  # a stream slot per choice (gateway/admission/stream_slots.py)
    stop = stop_list(req.stop)
    k = req.logprobs
    grammar = await engine.structured.compile(req.response_format)
    engine.speculators.check(req.speculation)

    specs: list[ChoiceSpec] = []
    for p, (ids, _) in enumerate(prompts):
        max_tokens = engine.max_tokens_for(len(ids), req.max_tokens, param="prompt")
        for j in range(n):
            index = p * n + j
            sampling = sampling_params(engine, req, choice_seed(req.seed, index), grammar)
            specs.append(
                ChoiceSpec(
                    index,
                    ids,
                    max_tokens,
                    sampling,
                    stop,
                    k,
                    prompt_logprobs=bool(req.echo) and k is not None,
                    speculation=req.speculation or "auto",
                    adapter=served.adapter,
                )
            )
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    model = served.id
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    NEED.set(admission_need(engine, specs))  # a 400 if the swarm could never hold it; else reserved
    generation = await engine.start(specs, session_key(request, req.user), cache_owner(request))
    route = RouteInfo.of(generation, engine.backend)  # x-swarm-route etc. (gateway/api/route_info.py)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        builder = CompletionChunkBuilder(
            id=completion_id,
            model=model,
            prompt_tokens=prompt_tokens,
            include_usage=include_usage,
            system_fingerprint=engine.system_fingerprint,
            vocab=engine.vocab,
            logprobs=k is not None,
        )
        return _streamed(generation, builder, route, req)

    results = await cancel_on_disconnect(request, generation.collect())
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = []
    for r in results:
        echo_text = prompts[r.index // n][1] if req.echo else ""
        logprobs = None
        if k is not None:
            legacy = LegacyLogprobs(engine.vocab)
            lps = (r.prompt_logprobs or []) + r.logprobs if req.echo else r.logprobs
            logprobs = legacy.build(lps)
        choices.append(
            CompletionChoice(finish_reason=r.finish_reason, index=r.index, logprobs=logprobs, text=echo_text + r.text)
        )
    response = Completion(
        id=completion_id,
        choices=choices,
        model=model,
        system_fingerprint=engine.system_fingerprint,
        usage=usage_of(prompt_tokens, results),
    )
    return _answered(response, route, req)


def _streamed(generation: Any, builder: Any, route: RouteInfo, req: Any) -> Response:
    """A streamed reply: SSE chunks from ``builder``, usage with cached tokens, the route's headers and the
    ignored fields' warning header."""
    return event_stream(generation, CachedTokensUsage(builder), headers=route.headers() | ignored_fields(req))


def _answered(response: ChatCompletion | Completion, route: RouteInfo, req: Any) -> JSONResponse:
    """A whole reply as JSON with the route's headers (the completion tokens counted) and the ignored fields'."""
    headers = route.headers(response.usage.completion_tokens) | ignored_fields(req)
    return JSONResponse(response.model_dump(mode="json"), headers=headers)


# -------------------------------------------------------------------------------------------- the checks


def _reject_unsupported_chat(req: ChatCompletionRequest) -> None:
    if req.functions:
        raise UnsupportedParameterError("functions", "is not supported (no function calling on this server)")
    if req.function_call not in (None, "none"):
        raise UnsupportedParameterError("function_call", "is not supported (no function calling on this server)")
    if req.audio is not None:
        raise UnsupportedParameterError("audio", "is not supported by this model")
    if req.modalities is not None and req.modalities != ["text"]:
        raise UnsupportedParameterError("modalities", "supports only ['text'] on this model")
    if req.reasoning_effort is not None:
        raise UnsupportedParameterError("reasoning_effort", "is not supported with this model")


async def chat_grammar(engine: Engine, req: ChatCompletionRequest, tools: ToolPlan | None) -> Any:
    """The constraint factory of a chat request: calls when ``tool_choice`` demands them (the reply is calls,
    so ``response_format`` has nothing to shape), else ``response_format``'s (None: free text)."""
    if tools is not None and tools.forced:
        fmt = tools.fmt
        opener = await engine.special_token_id(fmt.opener)
        lark = tool_call_grammar(tools.functions, fmt, parallel=tools.parallel, opener_token=opener)
        return await engine.structured.compile_lark(lark, param="tools")
    return await engine.structured.compile(req.response_format)  # structured outputs (a 400 if bad)


def _reply(result: ChoiceResult, tools: ToolPlan | None) -> tuple[ChatCompletionMessage, Any]:
    """A choice's message (its tool calls parsed out of the text) and finish reason."""
    if tools is None:
        return ChatCompletionMessage(content=result.text), result.finish_reason
    parsed = parse_tool_calls(result.text, tools.fmt, tools.max_calls)
    if not parsed.calls:
        return ChatCompletionMessage(content=parsed.content), result.finish_reason
    calls = [
        ChatCompletionMessageToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in parsed.calls
    ]
    finish = "tool_calls" if result.finish_reason == "stop" else result.finish_reason
    return ChatCompletionMessage(content=parsed.content, tool_calls=calls), finish


def _completion_prompts(
    engine: Engine, prompt: str | list[str] | list[int] | list[list[int]], requested: int | None
) -> list[tuple[list[int], str]]:
    """Every accepted shape of ``prompt`` → ``[(token ids, text to echo)]``; on the tokenize thread."""
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
            ids, text = engine.encode_sync(item, requested=requested), item
        else:
            if len(item) > engine.backend.max_context:  # refused before a million ids are checked, decoded
                engine.max_tokens_for(len(item), requested, param="prompt")
            bad = [t for t in item if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"{where}: token id {bad[0]} is out of range [0, {vocab}).", param=where)
            ids, text = item, engine.decode_sync(item)
        if not ids:
            raise InvalidRequestError(f"{where}: must not be empty.", param=where)
        out.append((ids, text))
    return out
