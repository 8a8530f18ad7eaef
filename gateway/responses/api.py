"""``POST /v1/responses`` (OpenAI's Responses API: text and function tools) on the engine, as
gateway/api/serving.py serves chat: request → checks (a 400 naming what we cannot serve, before any stream
starts) → chat messages and tools (gateway/responses/turn.py) → prompt ids → ``Engine.start`` → one response
object, or the Responses API's SSE events (gateway/responses/stream.py).

Conversation state: ``previous_response_id`` names a stored response of the same owner
(gateway/responses/store.py; in Redis with ``--redis-url``, so any replica finds it); the prompt is that
conversation (its inputs and outputs, calls and their results, in order) followed by the new input, with
this request's ``instructions`` as a system message in front. Every response of one
conversation passes the same session key to ``Engine.start`` (the ``X-Session-Id`` header or ``user`` when
the first turn had one, else a key made of the owner and the first response's id), so a follow-up resumes
the server-side KV caches of the turn before and reports them as ``usage.input_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from gateway.api.request_parts import CLIENT_CLOSED, admission_need, cache_owner, cancel_on_disconnect
from gateway.decode.capacity_queue import NEED
from gateway.decode.choices import ChoiceSpec
from gateway.decode.engine import Engine
from gateway.errors import GatewayError, InvalidRequestError
from gateway.responses.output import dump
from gateway.responses.schema import ResponseCreateRequest, check_supported
from gateway.responses.store import ResponseStore, StoredResponse
from gateway.responses.stream import response_events
from gateway.responses.turn import Turn

logger = logging.getLogger(__name__)

__all__ = ["ResponseNotFoundError", "create_response", "delete_response", "retrieve_response"]


class ResponseNotFoundError(GatewayError):
    """A response id that does not exist, expired, was not stored, or belongs to another API key."""

    status_code = 404
    type = "invalid_request_error"
    code = "not_found"

    def __init__(self, response_id: str, param: str | None = None):
        super().__init__(f"Response with id '{response_id}' not found.", param=param)


async def create_response(
    engine: Engine, req: ResponseCreateRequest, request: Request, store: ResponseStore
) -> Response:
    served = await engine.select_model(req.model)
    check_supported(req)
    previous: StoredResponse | None = None
    if req.previous_response_id is not None:
        previous = await store.get(req.previous_response_id, cache_owner(request))
        if previous is None:
            raise ResponseNotFoundError(req.previous_response_id, param="previous_response_id")
    turn = Turn(engine, req, request, served, previous)
    await turn.fit(store)
    constraint = await turn.constraint()
    keep_special = await turn.keeps_special_tokens()
    spec = ChoiceSpec(
        0,
        turn.prompt,
        turn.max_tokens,
        turn.sampling(constraint),
        turn.stop(),
        keep_special_tokens=keep_special,
        adapter=served.adapter,
    )
    try:  # a 400 if the swarm could never hold it; else its cache is reserved while it runs
        NEED.set(admission_need(engine, [spec]))
    except InvalidRequestError as exc:  # it speaks of chat's max_tokens; here it is max_output_tokens
        message = exc.message.replace("max_tokens", "max_output_tokens")
        raise InvalidRequestError(message, param="max_output_tokens", code=exc.code) from None
    generation = await engine.start([spec], turn.session_key, turn.owner)

    if req.stream:
        return EventSourceResponse(
            response_events(turn, generation, store), sep="\n", background=BackgroundTask(generation.aclose)
        )
    results = await cancel_on_disconnect(request, generation.collect())
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    result = results[0]
    items = turn.output()
    status = turn.status_of(result)
    items.start()  # the same items a stream builds, all at once
    items.feed(result.text)
    items.finish(status)
    response = turn.response(status, items.items, result)
    await turn.remember(store, items, response)
    return JSONResponse(dump(response))


async def retrieve_response(response_id: str, request: Request, store: ResponseStore) -> Response:
    entry = await store.get(response_id, cache_owner(request))
    if entry is None:
        raise ResponseNotFoundError(response_id)
    return JSONResponse(entry.response)


async def delete_response(response_id: str, request: Request, store: ResponseStore) -> Response:
    if not await store.delete(response_id, cache_owner(request)):
        raise ResponseNotFoundError(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
