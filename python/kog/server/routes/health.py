"""GET /health (503 once draining or failed, so a load balancer stops sending) and GET /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kog.server.responses import Health
from kog.server.state import get_state

router = APIRouter(tags=["ops"])


@router.get("/health", response_model=Health, responses={503: {"model": Health, "description": "Draining or failed"}})
async def health(request: Request) -> JSONResponse:
    """200 while accepting requests; 503 when draining (with Retry-After) or after an engine failure."""
    state = get_state(request)
    s = state.engine.stats()
    status = "failed" if s["dead"] else "ok" if s["accepting"] else "draining"
    body = Health(status=status, running=s["running"], waiting=s["waiting"], kv_usage=s["kv_usage"])
    headers = {"Retry-After": str(state.config.retry_after_s)} if status == "draining" else None
    return JSONResponse(body.model_dump(), status_code=200 if status == "ok" else 503, headers=headers)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                             "description": "Prometheus text format"}})
async def metrics(request: Request) -> Response:
    """Prometheus metrics (see docs/SERVER.md)."""
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
