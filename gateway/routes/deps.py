"""Dependencies shared by the routers, as ``Annotated`` aliases so handler signatures read like the domain."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

from fastapi import Depends, Request

from gateway.backend import ModelBackend
from gateway.engine import Engine
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest, OpenAIRequestModel, parse_request
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


EngineDep = Annotated[Engine, Depends(_engine)]
BackendDep = Annotated[ModelBackend, Depends(_backend)]
SettingsDep = Annotated[GatewaySettings, Depends(_settings)]
ChatBody = Annotated[ChatCompletionRequest, Depends(_body(ChatCompletionRequest))]
CompletionBody = Annotated[CompletionRequest, Depends(_body(CompletionRequest))]
