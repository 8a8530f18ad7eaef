from fastapi import APIRouter, Request

from gateway.openai_schema import Model, ModelList
from gateway.routes.deps import EngineDep

router = APIRouter(tags=["openai"])


def _model(request: Request, engine: EngineDep) -> Model:
    return Model(id=engine.model_id, created=request.app.state.started_at)


@router.get("/v1/models")
async def list_models(request: Request, engine: EngineDep) -> ModelList:
    return ModelList(data=[_model(request, engine)])


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request, engine: EngineDep) -> Model:
    engine.check_model(model_id)
    return _model(request, engine)
