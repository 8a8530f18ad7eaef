from fastapi import APIRouter, Request, Response

from gateway.api.serving import create_completion
from gateway.routes.deps import CompletionBody, EngineDep, openapi_body
from gateway.schema.requests import CompletionRequest

router = APIRouter(tags=["openai"])


@router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
async def completions(body: CompletionBody, engine: EngineDep, request: Request) -> Response:
    return await create_completion(engine, body, request)
