"""OpenAI's model list: the one model this router serves (``--served-model-name``)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from distserve.server.router.state import router_state

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request):
    state = router_state(request)
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name(),
                "object": "model",
                "created": state.created,
                "owned_by": "distserve",
                "max_model_len": state.max_seq_len(),
            }
        ],
    }
