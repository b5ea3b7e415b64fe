"""Ungated operational routes: liveness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from openalice_scheduler.models import Health

router = APIRouter(tags=["ops"])


@router.get("/health", response_model=Health, summary="Liveness")
async def health() -> Health:
    # Liveness only: a Docker or database outage must not make the balancer kill us.
    return Health()


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    state = request.app.state
    body = await state.scrape.render(
        state.service, owner_series=state.settings.metrics_owner_series
    )
    return Response(body, media_type=CONTENT_TYPE_LATEST)
