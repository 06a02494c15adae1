"""OpenAI's model list and model retrieval: the one model this router serves (``--served-model-name``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from distserve.server.router.state import RouterState, router_state

router = APIRouter()


def _model_card(state: RouterState) -> dict[str, Any]:
    return {
        "id": state.model_name(),
        "object": "model",
        "created": state.created,
        "owned_by": "distserve",
        "max_model_len": state.max_seq_len(),
    }


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [_model_card(router_state(request))]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str):
    """``client.models.retrieve(id)``: the served model's card under any name a request may use for it
    (the served name or the ``--model`` path, as ``check_model`` accepts), else OpenAI's 404 model_not_found."""
    state = router_state(request)
    state.check_model(model)
    return _model_card(state)
