"""The endpoints that describe the server: /health, /metrics, /v1/models, and /v1/embeddings (not offered)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .protocol import BadRequest
from .served import Served, error_response


def router(served: Served) -> APIRouter:
    from .metrics import CONTENT_TYPE_LATEST

    routes = APIRouter()

    @routes.get("/health")
    async def health():
        return {"status": "ok" if served.manager.is_running() else "stopped"}

    @routes.get("/metrics")
    async def prometheus():
        return Response(served.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @routes.get("/v1/models")
    async def models():
        model = {
            "id": served.settings.model_name,
            "object": "model",
            "created": served.created,
            "owned_by": "decodekit",
        }
        return {"object": "list", "data": [model]}

    @routes.post("/v1/embeddings")
    async def embeddings(request: Request):
        """Not offered: a 404 that says so, where a client would otherwise get a bare "Not Found"."""
        return error_response(
            BadRequest(
                "/v1/embeddings is not offered by decodekit serve: it serves generation (/v1/completions, "
                "/v1/chat/completions) for causal language models, whose hidden states are no trained embedding; use an "
                "embedding model's own server.",
                None,
                404,
                "not_found_error",
            )
        )

    return routes
