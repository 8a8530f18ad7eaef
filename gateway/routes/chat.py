from fastapi import APIRouter, Request, Response

from gateway.openai_schema import ChatCompletionRequest
from gateway.routes.deps import ChatBody, EngineDep, openapi_body
from gateway.serving import create_chat_completion

router = APIRouter(tags=["openai"])


@router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
async def chat_completions(body: ChatBody, engine: EngineDep, request: Request) -> Response:
    return await create_chat_completion(engine, body, request)
