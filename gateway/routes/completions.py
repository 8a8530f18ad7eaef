from fastapi import APIRouter, Request, Response

from gateway.openai_schema import CompletionRequest
from gateway.routes.deps import CompletionBody, EngineDep, openapi_body
from gateway.serving import create_completion

router = APIRouter(tags=["openai"])


@router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
async def completions(body: CompletionBody, engine: EngineDep, request: Request) -> Response:
    return await create_completion(engine, body, request)
