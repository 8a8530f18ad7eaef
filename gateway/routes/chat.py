from fastapi import APIRouter, Request, Response

from gateway.api.serving import create_chat_completion
from gateway.routes.deps import ChatBody, EngineDep, openapi_body
from gateway.schema.requests import ChatCompletionRequest

router = APIRouter(tags=["openai"])


@router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
async def chat_completions(body: ChatBody, engine: EngineDep, request: Request) -> Response:
    return await create_chat_completion(engine, body, request)
