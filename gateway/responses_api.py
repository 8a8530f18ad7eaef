"""``POST /v1/responses`` (OpenAI's Responses API, text only) on the engine, as gateway/serving.py serves chat:
request → checks (a 400 naming what we cannot serve, before any stream starts) → chat messages → prompt ids
→ ``Engine.start`` → one response object, or the Responses API's SSE events.

Conversation state: ``previous_response_id`` names a stored response of the same API key
(gateway/responses_store.py); the prompt is that conversation (its inputs and outputs, in order) followed by
the new input, with this request's ``instructions`` as a system message in front. Every response of one
conversation passes the same session key to ``Engine.start`` (the ``X-Session-Id`` header or ``user`` when
the first turn had one, else a key made of the owner and the first response's id), so a follow-up resumes
the server-side KV caches of the turn before and reports them as ``usage.input_tokens_details.cached_tokens``.

A stream is ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``…, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, then ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it short), each SSE frame with ``event: <type>`` and
a ``sequence_number`` counting from 0. An error after the 200 is an ``error`` event and ``response.failed``.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from gateway.adapters import ServedModel
from gateway.capacity_queue import NEED
from gateway.choices import ChoiceResult, ChoiceSpec
from gateway.engine import Engine
from gateway.errors import ContextLengthExceededError, GatewayError, InvalidRequestError, to_gateway_error
from gateway.generation import Generation
from gateway.request_parts import (
    CLIENT_CLOSED,
    admission_need,
    cache_owner,
    cancel_on_disconnect,
    sampling_params,
    session_key,
)
from gateway.responses_schema import (
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseCreateRequest,
    ResponseError,
    ResponseObject,
    ResponseUsage,
    check_supported,
    input_messages,
    response_format_of,
)
from gateway.responses_store import ResponsesStore, StoredResponse, owner_of
from gateway.sampling import SamplingParams, choice_seed

logger = logging.getLogger(__name__)

__all__ = ["ResponseNotFoundError", "create_response", "delete_response", "retrieve_response"]


class ResponseNotFoundError(GatewayError):
    """A response id that does not exist, expired, was not stored, or belongs to another API key."""

    status_code = 404
    type = "invalid_request_error"
    code = "not_found"

    def __init__(self, response_id: str, param: str | None = None):
        super().__init__(f"Response with id '{response_id}' not found.", param=param)


class _Turn:
    """One request, checked and rendered: everything both the JSON and the SSE answer need."""

    def __init__(
        self, engine: Engine, req: ResponseCreateRequest, request: Request, store: ResponsesStore, served: ServedModel
    ):
        self.engine = engine
        #: the base model or the LoRA adapter the request's ``model`` names
        self.served = served
        self.req = req
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.owner = owner_of(request)
        previous: StoredResponse | None = None
        if req.previous_response_id is not None:
            previous = store.get(req.previous_response_id, self.owner)
            if previous is None:
                raise ResponseNotFoundError(req.previous_response_id, param="previous_response_id")
        #: the conversation without instructions: what a follow-up continues
        self.conversation = (previous.messages if previous else []) + input_messages(req)
        if not self.conversation:
            raise InvalidRequestError("input: must contain at least one item.", param="input")
        if previous is not None:
            self.session_key = previous.session_key
        else:
            self.session_key = session_key(request, req.user) or f"responses:{self.owner or '-'}:{self.id}"
        #: the prompt ids and completion budget, set by ``fit``
        self.prompt: list[int] = []
        self.max_tokens = 0
        self.model = served.id
        self.created = ResponseObject(id=self.id, status="in_progress", model=self.model).created_at

    async def fit(self) -> None:
        """Render the prompt on the engine's tokenize thread (never on the event loop: prompts can be
        megabytes) and set ``prompt`` and ``max_tokens``."""
        self.prompt, self.max_tokens = await self.engine.tokenize.run(self._fit, self.engine)

    def _fit(self, engine: Engine) -> tuple[list[int], int]:
        """The prompt ids and the completion budget; ``truncation: "auto"`` drops the oldest turns (never
        the system messages, never the last item) until they fit the context window. On the tokenize
        thread."""
        head = [{"role": "system", "content": self.req.instructions}] if self.req.instructions else []
        turns = list(self.conversation)
        while True:
            requested = self.req.max_output_tokens
            try:
                prompt = engine.render_chat_sync(head + turns, requested=requested, param="input")
                return prompt, engine.max_tokens_for(len(prompt), requested, param="input")
            except ContextLengthExceededError:
                droppable = [i for i, m in enumerate(turns[:-1]) if m["role"] != "system"]
                if self.req.truncation != "auto" or not droppable:
                    raise
                del turns[droppable[0]]

    def sampling(self, grammar: Any) -> SamplingParams:
        return sampling_params(self.engine, self.req, choice_seed(self.req.seed, 0), grammar)

    def response(
        self,
        status: str,
        text: str | None = None,
        result: ChoiceResult | None = None,
        error: GatewayError | None = None,
    ) -> ResponseObject:
        """The response object in ``status``; ``text`` None: no output item yet."""
        req = self.req
        output = []
        if text is not None:
            item_status = {"completed": "completed", "in_progress": "in_progress"}.get(status, "incomplete")
            output.append(OutputMessage(id=self.message_id, status=item_status, content=[OutputText(text=text)]))
        usage = None
        if result is not None:
            usage = ResponseUsage(
                input_tokens=len(self.prompt),
                input_tokens_details=InputTokensDetails(cached_tokens=result.cached_tokens),
                output_tokens=result.completion_tokens,
                total_tokens=len(self.prompt) + result.completion_tokens,
            )
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            status=status,  # type: ignore[arg-type]  # one of the four, by construction
            error=ResponseError(code=error.code or error.type, message=error.message) if error else None,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            max_tool_calls=req.max_tool_calls,
            model=self.model,
            output=output,
            parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            previous_response_id=req.previous_response_id,
            store=req.store is not False,
            temperature=1.0 if req.temperature is None else req.temperature,
            text=req.text or {"format": {"type": "text"}},
            tool_choice=req.tool_choice or "auto",
            top_p=1.0 if req.top_p is None else req.top_p,
            truncation=req.truncation or "disabled",
            usage=usage,
            user=req.user,
            metadata=req.metadata or {},
        )

    def finished(self, result: ChoiceResult) -> ResponseObject:
        return self.response("incomplete" if result.finish_reason == "length" else "completed", result.text, result)

    def remember(self, store: ResponsesStore, result: ChoiceResult, response: ResponseObject) -> None:
        if self.req.store is False:
            return
        messages = [*self.conversation, {"role": "assistant", "content": result.text}]
        store.put(StoredResponse(self.id, self.owner, self.session_key, messages, _json(response)))


async def create_response(
    engine: Engine, req: ResponseCreateRequest, request: Request, store: ResponsesStore
) -> Response:
    served = await engine.select_model(req.model)
    check_supported(req)
    turn = _Turn(engine, req, request, store, served)
    await turn.fit()
    response_format = response_format_of(req.text)
    try:
        grammar = await engine.structured.compile(response_format)
    except InvalidRequestError as exc:  # it speaks of chat's response_format; here it is text.format
        message = exc.message.replace("response_format", "text.format")
        raise InvalidRequestError(message, param="text.format", code=exc.code) from None
    spec = ChoiceSpec(0, turn.prompt, turn.max_tokens, turn.sampling(grammar), adapter=served.adapter)
    try:  # a 400 if the swarm could never hold it; else its cache is reserved while it runs
        NEED.set(admission_need(engine, [spec]))
    except InvalidRequestError as exc:  # it speaks of chat's max_tokens; here it is max_output_tokens
        message = exc.message.replace("max_tokens", "max_output_tokens")
        raise InvalidRequestError(message, param="max_output_tokens", code=exc.code) from None
    generation = await engine.start([spec], turn.session_key, cache_owner(request))

    if req.stream:
        return EventSourceResponse(
            _events(turn, generation, store), sep="\n", background=BackgroundTask(generation.aclose)
        )
    results = await cancel_on_disconnect(request, generation.collect())
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    response = turn.finished(results[0])
    turn.remember(store, results[0], response)
    return JSONResponse(_json(response))


async def retrieve_response(response_id: str, request: Request, store: ResponsesStore) -> Response:
    entry = store.get(response_id, owner_of(request))
    if entry is None:
        raise ResponseNotFoundError(response_id)
    return JSONResponse(entry.response)


async def delete_response(response_id: str, request: Request, store: ResponsesStore) -> Response:
    if not store.delete(response_id, owner_of(request)):
        raise ResponseNotFoundError(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


# ------------------------------------------------------------------------------------------------ streaming


def _json(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")


class _Sequencer:
    """SSE frames ``event: <type>`` + ``data: {..., "sequence_number": n}``, n counting from 0."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, type_: str, **fields: Any) -> dict[str, str]:
        payload = {"type": type_, "sequence_number": self.n, **fields}
        self.n += 1
        return {"event": type_, "data": json.dumps(payload, separators=(",", ":"), ensure_ascii=False)}


async def _events(turn: _Turn, generation: Generation, store: ResponsesStore) -> AsyncIterator[dict[str, str]]:
    event = _Sequencer()
    ids = {"item_id": turn.message_id, "output_index": 0, "content_index": 0}
    result = ChoiceResult(0)
    item_open = False
    try:
        yield event("response.created", response=_json(turn.response("in_progress")))
        yield event("response.in_progress", response=_json(turn.response("in_progress")))
        item = OutputMessage(id=turn.message_id, status="in_progress", content=[])
        yield event("response.output_item.added", output_index=0, item=_json(item))
        yield event("response.content_part.added", **ids, part=_json(OutputText(text="")))
        item_open = True
        async for delta in generation:
            result.add(delta)
            if delta.text:
                yield event("response.output_text.delta", **ids, delta=delta.text, logprobs=[])
        final = turn.finished(result)
        part = OutputText(text=result.text)
        yield event("response.output_text.done", **ids, text=result.text, logprobs=[])
        yield event("response.content_part.done", **ids, part=_json(part))
        yield event("response.output_item.done", output_index=0, item=_json(final.output[0]))
        turn.remember(store, result, final)
        yield event(f"response.{final.status}", response=_json(final))
    except Exception as exc:  # the 200 is out: the error goes in the stream
        err = to_gateway_error(exc)
        log = logger.exception if err.status_code == 500 else logger.warning  # a trace only for bugs
        log("response stream failed after it started: %s", err.message)
        yield event("error", code=err.code or err.type, message=err.message, param=err.param)
        failed = turn.response("failed", result.text if item_open else None, result, err)
        yield event("response.failed", response=_json(failed))
    finally:
        await generation.aclose()
