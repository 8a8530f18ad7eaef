"""Dependencies shared by the routers, as ``Annotated`` aliases so handler signatures read like the domain."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel

from gateway.api.openapi_responses import generation_responses
from gateway.backends.base import ModelBackend
from gateway.decode.engine import Engine
from gateway.schema.base import OpenAIRequestModel, parse_request
from gateway.schema.requests import ChatCompletionRequest, CompletionRequest
from gateway.settings import GatewaySettings

RequestT = TypeVar("RequestT", bound=OpenAIRequestModel)


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def _backend(request: Request) -> ModelBackend:
    return request.app.state.backend


def _settings(request: Request) -> GatewaySettings:
    return request.app.state.settings


def _body(model_cls: type[RequestT]) -> Callable[[Request], Awaitable[RequestT]]:
    """Parse the body ourselves (not through FastAPI's 422 machinery): strict types, and every failure a
    400 in OpenAI's envelope that names the parameter."""

    async def parse(request: Request) -> RequestT:
        return parse_request(model_cls, await request.body())

    return parse


def openapi_body(model_cls: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model_cls`` as the JSON request body, and the route's answers (SSE,
    errors: ``gateway.api.openapi_responses``). ``_body`` parses bodies itself, so
    FastAPI would leave them out of the OpenAPI schema (and clients or fuzzers built from it would send none).
    Pydantic's ``$defs`` are inlined: the schema sits inside the document, where ``#/$defs/...`` resolves
    against the document's root."""
    schema = model_cls.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    content = {"application/json": {"schema": inline(schema)}}
    return {"requestBody": {"required": True, "content": content}, "responses": generation_responses()}


EngineDep = Annotated[Engine, Depends(_engine)]
BackendDep = Annotated[ModelBackend, Depends(_backend)]
SettingsDep = Annotated[GatewaySettings, Depends(_settings)]
ChatBody = Annotated[ChatCompletionRequest, Depends(_body(ChatCompletionRequest))]
CompletionBody = Annotated[CompletionRequest, Depends(_body(CompletionRequest))]
