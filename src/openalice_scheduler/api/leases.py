"""Lease routes: thin, over LeaseService. Gated by SecretGate (see app.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response, Security
from fastapi.responses import JSONResponse
from fastapi.security import APIKeyHeader

from openalice_scheduler.api.deps import LeaseOwner, ServiceDep
from openalice_scheduler.models import AcquireResponse, ErrorBody, Lease, LeaseRequest

# Enforced by SecretGate before routing (so even a malformed body gets 401 first); declared
# here so that /openapi.json shows the requirement.
_secret = APIKeyHeader(name="X-Internal-Secret", auto_error=False)
router = APIRouter(prefix="/v1", tags=["leases"], dependencies=[Security(_secret)])

_UNAUTHORIZED: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or wrong X-Internal-Secret"}
}


@router.post(
    "/lease",
    response_model=AcquireResponse,
    summary="Acquire a worker",
    responses={
        **_UNAUTHORIZED,
        413: {"model": ErrorBody, "description": "Body larger than 1 MiB"},
        422: {"model": ErrorBody, "description": "Invalid body; `field` names the field"},
        502: {"model": ErrorBody, "description": "Every candidate provider failed to provision"},
        503: {"model": ErrorBody, "description": "No provider can serve the request now"},
    },
)
async def acquire(body: LeaseRequest, service: ServiceDep) -> JSONResponse:
    record = await service.acquire(body)
    return JSONResponse({"lease": record.wire(), "provider": record.provider})


@router.delete(
    "/lease/{lease_id}",
    status_code=204,
    summary="Release a lease and destroy its worker",
    responses={
        **_UNAUTHORIZED,
        403: {"model": ErrorBody, "description": "X-Lease-Owner missing or different"},
        404: {"model": ErrorBody, "description": "Unknown or already released"},
        409: {"model": ErrorBody, "description": "The lease is still provisioning"},
        502: {"model": ErrorBody, "description": "The provider failed; retried in background"},
    },
)
async def release(lease_id: str, service: ServiceDep, owner: LeaseOwner = None) -> Response:
    await service.release(lease_id, owner)
    return Response(status_code=204)


@router.get(
    "/leases",
    response_model=list[Lease],
    summary="List active leases",
    responses=_UNAUTHORIZED,
)
async def list_leases(service: ServiceDep) -> Response:
    # Encoded by the store, which reuses each unchanged lease's JSON between listings.
    return Response(await service.list_active_json(), media_type="application/json")
