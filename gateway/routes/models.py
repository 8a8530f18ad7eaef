from fastapi import APIRouter, Request

from gateway.backends.adapters import ServedModel
from gateway.routes.deps import EngineDep
from gateway.schema.replies import Model, ModelList

router = APIRouter(tags=["openai"])


def _model(request: Request, engine: EngineDep, served: ServedModel) -> Model:
    base = engine.model_id
    parent = base if served.adapter is not None else None
    return Model(id=served.id, created=request.app.state.started_at, root=base, parent=parent)


@router.get("/v1/models")
async def list_models(request: Request, engine: EngineDep) -> ModelList:
    """The base model, and each LoRA adapter the swarm serves as ``BASE:NAME`` (and its aliases)."""
    return ModelList(data=[_model(request, engine, m) for m in await engine.served_models()])


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request, engine: EngineDep) -> Model:
    return _model(request, engine, await engine.select_model(model_id))
