"""Ungated operational routes: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from openalice_scheduler.errors import StoreUnavailable
from openalice_scheduler.models import Health, Readiness

router = APIRouter(tags=["ops"])


@router.get("/health", response_model=Health, summary="Liveness")
async def health() -> Health:
    # Liveness only: a Docker or database outage must not make the balancer kill us.
    return Health()


@router.get(
    "/readyz",
    response_model=Readiness,
    response_model_exclude_none=True,
    summary="Readiness: whether to send this process traffic",
    responses={503: {"model": Readiness, "description": "Not ready: `reasons` says why "
                     "(`error` `shutting_down` while draining after SIGTERM, else "
                     "`not_ready`)"}},
)
async def readyz(request: Request) -> JSONResponse:
    readiness = request.app.state.readiness
    reasons = await readiness.reasons()
    if not reasons:
        return JSONResponse({"ready": True})
    error = "shutting_down" if readiness.draining else "not_ready"
    return JSONResponse(
        {"ready": False, "reasons": reasons, "error": error,
         "message": "not ready: " + ", ".join(reasons)},
        status_code=503,
    )


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    state = request.app.state
    counts: dict[str, int] | None = None
    owners: dict[str, int] | None = None
    try:
        counts = await state.service.store.count_by_state()
        # Owner ids on an ungated page only when the operator asks for them.
        if state.settings.metrics_owner_series:
            held: dict[str, int] = {}
            for _provider, _kind, _gpu, owner, count in await state.service.store.count_held():
                if owner is not None:
                    held[owner] = held.get(owner, 0) + count
            owners = held
    except StoreUnavailable:
        pass
    return Response(state.metrics.render(counts, owners), media_type=CONTENT_TYPE_LATEST)
