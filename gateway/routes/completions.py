from fastapi import APIRouter, Request, Response

from gateway.routes.deps import CompletionBody, EngineDep
from gateway.serving import create_completion

router = APIRouter(tags=["openai"])


@router.post("/v1/completions")
async def completions(body: CompletionBody, engine: EngineDep, request: Request) -> Response:
    return await create_completion(engine, body, request)
