"""``/v1/responses``: create (``POST``), retrieve (``GET /{id}``), delete (``DELETE /{id}``), handed to
gateway/responses/api.py. The stored responses live in ``app.state.responses_store`` (made by the app: in
Redis with ``--redis-url``, else in memory; gateway/responses/store.py)."""

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from gateway.responses.api import create_response, delete_response, retrieve_response
from gateway.responses.schema import ResponseCreateRequest
from gateway.responses.store import ResponseStore
from gateway.routes.deps import EngineDep, openapi_body
from gateway.schema.base import parse_request

router = APIRouter(tags=["openai"])


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses_store


async def _body(request: Request) -> ResponseCreateRequest:
    return parse_request(ResponseCreateRequest, await request.body())


StoreDep = Annotated[ResponseStore, Depends(_store)]
ResponseBody = Annotated[ResponseCreateRequest, Depends(_body)]


@router.post("/v1/responses", openapi_extra=openapi_body(ResponseCreateRequest))
async def responses(body: ResponseBody, engine: EngineDep, store: StoreDep, request: Request) -> Response:
    return await create_response(engine, body, request, store)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, store: StoreDep, request: Request) -> Response:
    return await retrieve_response(response_id, request, store)


@router.delete("/v1/responses/{response_id}")
async def remove_response(response_id: str, store: StoreDep, request: Request) -> Response:
    return await delete_response(response_id, request, store)
