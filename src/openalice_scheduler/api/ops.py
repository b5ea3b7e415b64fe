"""Ungated operational routes: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from openalice_scheduler.api.openapi import errors
from openalice_scheduler.errors import NotReady, ShuttingDown
from openalice_scheduler.models import Health, Readiness

router = APIRouter(tags=["ops"])


@router.get("/health", response_model=Health, summary="Liveness")
async def health() -> Health:
    # Liveness only: a Docker or database outage must not make the balancer kill us.
    return Health()


@router.get(
    "/readyz",
    response_model=Readiness,
    summary="Readiness: whether to send this process traffic",
    responses={
        503: {
            **errors(503)[503],
            "description": "`not_ready`: `reasons` says why "
            "(store unavailable, start-up reconciliation not finished); "
            "`shutting_down`: draining after SIGTERM",
        }
    },
)
async def readyz(request: Request) -> Readiness:
    readiness = request.app.state.readiness
    reasons = await readiness.reasons()
    if not reasons:
        return Readiness()
    message = "not ready: " + ", ".join(reasons)
    error = ShuttingDown if readiness.draining else NotReady
    raise error(message, ready=False, reasons=reasons)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    state = request.app.state
    body = await state.scrape.render(
        state.service, owner_series=state.settings.metrics_owner_series
    )
    return Response(body, media_type=CONTENT_TYPE_LATEST)
