"""Lease and provider routes: thin, over LeaseService. Gated by SecretGate (see app.py)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response, Security
from fastapi.responses import JSONResponse
from fastapi.security import APIKeyHeader

from openalice_scheduler.api.deps import LeaseOwner, ServiceDep
from openalice_scheduler.api.fast import watch_disconnect
from openalice_scheduler.models import (
    AcquireResponse,
    ErrorBody,
    Lease,
    LeaseRequest,
    LeaseState,
    ProviderView,
    RenewRequest,
    Token,
    WorkerKind,
)

# POST /v1/lease and DELETE /v1/lease/{id} are usually answered by api/fast.py before
# they reach these routes; these stay their definition and serve what it hands on.
# Enforced by SecretGate before routing (so even a malformed body gets 401 first); declared
# here so that /openapi.json shows the requirement.
_secret = APIKeyHeader(name="X-Internal-Secret", auto_error=False)
router = APIRouter(prefix="/v1", tags=["leases"], dependencies=[Security(_secret)])


def _errors(**described: str) -> dict[int | str, dict[str, Any]]:
    responses: dict[int | str, dict[str, Any]] = {
        401: {"model": ErrorBody, "description": "Missing or wrong X-Internal-Secret"}
    }
    for status, description in described.items():
        responses[int(status.removeprefix("s"))] = {"model": ErrorBody,
                                                   "description": description}
    return responses


@router.post(
    "/lease",
    response_model=AcquireResponse,
    summary="Acquire a worker",
    responses=_errors(
        s413="Body larger than 1 MiB",
        s422="Invalid body; `field` names the field",
        s429="The owner holds MAX_LEASES_PER_OWNER leases",
        s502="Every candidate provider failed to provision",
        s503="No provider can serve the request now (after `wait_seconds`); see Retry-After",
    ),
)
async def acquire(body: LeaseRequest, request: Request, service: ServiceDep) -> JSONResponse:
    # A caller that hangs up while waiting or provisioning gets no worker: the lease is
    # given back as soon as it exists.
    gone = asyncio.Event()
    watcher = asyncio.create_task(watch_disconnect(request.receive, gone))
    try:
        record = await service.acquire(body, gone=gone)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    return JSONResponse({"lease": record.wire(), "provider": record.provider})


@router.get(
    "/lease/{lease_id}",
    response_model=Lease,
    summary="Look a lease up, in any state",
    responses=_errors(s404="Unknown lease"),
)
async def get_lease(lease_id: str, service: ServiceDep) -> JSONResponse:
    return JSONResponse((await service.get(lease_id)).wire())


@router.post(
    "/lease/{lease_id}/renew",
    response_model=Lease,
    summary="Extend a lease: expires_at = now + ttl (default: its own TTL), at most 8 h ahead",
    responses=_errors(
        s403="X-Lease-Owner missing or different",
        s404="Unknown, expired, releasing or released: a lease is never resurrected",
        s422="Invalid body",
    ),
)
async def renew(
    lease_id: str, service: ServiceDep, body: RenewRequest | None = None,
    owner: LeaseOwner = None,
) -> JSONResponse:
    ttl = body.ttl_seconds if body is not None else None
    return JSONResponse((await service.renew(lease_id, owner, ttl)).wire())


@router.delete(
    "/lease/{lease_id}",
    status_code=204,
    summary="Release a lease and destroy its worker",
    responses=_errors(
        s403="X-Lease-Owner missing or different",
        s404="Unknown or already released",
        s409="The lease is still provisioning",
        s502="The provider failed; the lease stays releasing and is retried",
    ),
)
async def release(lease_id: str, service: ServiceDep, owner: LeaseOwner = None) -> Response:
    await service.release(lease_id, owner)
    return Response(status_code=204)


@router.get(
    "/leases",
    response_model=list[Lease],
    summary="List leases: the active ones, or those matching the filters",
    responses=_errors(s422="Unknown filter value"),
)
async def list_leases(
    service: ServiceDep,
    state: Annotated[list[LeaseState] | None, Query(description="Repeatable.")] = None,
    owner_id: Annotated[Token | None, Query()] = None,
    kind: WorkerKind | None = None,
    provider: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000, description="For filtered lists.")] = 1000,
) -> Response:
    if state is None and owner_id is None and kind is None and provider is None:
        # The original contract: exactly the active leases. Encoded by the store, which
        # reuses each unchanged lease's JSON between listings.
        return Response(await service.list_active_json(), media_type="application/json")
    found = await service.search(
        states=state or [LeaseState.active], owner_id=owner_id,
        kind=kind.value if kind else None, provider=provider, limit=limit,
    )
    return JSONResponse(found)


@router.get(
    "/providers",
    response_model=list[ProviderView],
    summary="Providers: health, capacity and use per GPU class",
    responses=_errors(),
)
async def providers(service: ServiceDep) -> JSONResponse:
    return JSONResponse(await service.provider_view())

