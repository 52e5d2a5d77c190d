"""GET /v1/models: the served model names."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from kog.server.responses import ModelCard, ModelList
from kog.server.routes.common import ERROR_RESPONSES
from kog.server.state import get_state, require_api_key

router = APIRouter(tags=["openai"], dependencies=[Depends(require_api_key)])


@router.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]})
async def list_models(request: Request) -> ModelList:
    """The served model names, each with the context length."""
    state = get_state(request)
    return ModelList(data=[ModelCard(id=name, created=state.created, max_model_len=state.max_model_len)
                           for name in state.config.served_model_names])
