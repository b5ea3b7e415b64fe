"""Lease and provider routes: thin, over LeaseService, and the one definition of each
call (and of /openapi.json: each function's name is its operation id, see
openapi.operation_id). The rules every request meets first (secret, body and
header limits, duplicate headers) are middleware (middleware.py)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated, Literal

from fastapi import APIRouter, Body, Query, Request, Response, Security
from fastapi.responses import JSONResponse

from openalice_scheduler import timings
from openalice_scheduler.api.deps import SECRET_HEADER, LeaseOwner, ServiceDep
from openalice_scheduler.api.hangup import watch_hangup
from openalice_scheduler.api.openapi import errors
from openalice_scheduler.models import (
    AcquireResponse,
    Lease,
    LeaseRequest,
    LeaseState,
    PoolView,
    ProviderView,
    RenewRequest,
    Token,
    Waiting,
    WorkerKind,
)

router = APIRouter(prefix="/v1", tags=["leases"], dependencies=[Security(SECRET_HEADER)])


@router.post(
    "/lease",
    response_model=AcquireResponse,
    summary="Acquire a worker",
    responses=errors(422, 429, 502, 503),
)
async def acquire_lease(body: LeaseRequest, request: Request, service: ServiceDep) -> JSONResponse:
    # A caller that hangs up while waiting or provisioning gets no worker: the lease is
    # given back as soon as it exists.
    gone = asyncio.Event()
    watcher = asyncio.create_task(watch_hangup(request.scope, request.receive, gone))
    try:
        with timings.collect() as tally:
            record = await service.acquire(body, gone=gone)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    return JSONResponse(
        {"lease": record.wire(), "provider": record.provider},
        headers={"Server-Timing": tally.header()},
    )


@router.get(
    "/lease/{lease_id}",
    response_model=Lease,
    summary="Look a lease up, in any state",
    responses=errors(404, 422, 503),
)
async def get_lease(lease_id: str, service: ServiceDep) -> JSONResponse:
    return JSONResponse((await service.get(lease_id)).wire())


@router.post(
    "/lease/{lease_id}/renew",
    response_model=Lease,
    summary="Extend a lease: expires_at = now + ttl (default: its own TTL), at most 8 h ahead",
    responses=errors(403, 404, 409, 422, 503),
)
async def renew_lease(
    lease_id: str,
    service: ServiceDep,
    # Optional, and described as a plain RenewRequest (not anyOf [RenewRequest, null]):
    # generated clients then send no body rather than `null`.
    body: RenewRequest = Body(default=None),  # noqa: B008
    owner: LeaseOwner = None,
) -> JSONResponse:
    ttl = body.ttl_seconds if body is not None else None
    return JSONResponse((await service.renew(lease_id, owner, ttl)).wire())


@router.delete(
    "/lease/{lease_id}",
    status_code=204,
    summary="Release a lease and destroy its worker",
    responses=errors(403, 404, 409, 422, 502, 503),
)
async def release_lease(lease_id: str, service: ServiceDep, owner: LeaseOwner = None) -> Response:
    await service.release(lease_id, owner)
    return Response(status_code=204)


@router.get(
    "/leases",
    response_model=list[Lease],
    summary="List leases: the active ones, or those matching the filters",
    responses=errors(422, 503),
)
async def list_leases(
    service: ServiceDep,
    state: Annotated[list[LeaseState] | None, Query(description="Repeatable.")] = None,
    owner_id: Annotated[Token | None, Query()] = None,
    kind: WorkerKind | None = None,
    provider: Annotated[str | None, Query(max_length=64)] = None,
    # A query string's "60.0" is taken as 60, as in a body (JSON Schema's integer).
    limit: Annotated[int, Query(ge=1, le=10_000, description="For filtered lists.")] = 1000,
    order: Annotated[
        Literal["oldest", "newest"],
        Query(
            description="By created_at: `oldest` first (the default) or `newest` first, so "
            "that `limit` keeps the most recent (the dashboard's recent releases)."
        ),
    ] = "oldest",
) -> Response:
    if (
        state is None
        and owner_id is None
        and kind is None
        and provider is None
        and order == "oldest"
    ):
        # The original contract: exactly the active leases. Encoded by the store, which
        # reuses each unchanged lease's JSON between listings.
        return Response(await service.list_active_json(), media_type="application/json")
    found = await service.search(
        states=state or [LeaseState.active],
        owner_id=owner_id,
        kind=kind.value if kind else None,
        provider=provider,
        limit=limit,
        newest_first=order == "newest",
    )
    return JSONResponse(found)


@router.get(
    "/providers",
    response_model=list[ProviderView],
    summary="Providers: health, capacity and use per GPU class",
    responses=errors(503),
)
async def list_providers(service: ServiceDep) -> JSONResponse:
    return JSONResponse(await service.provider_view())


@router.get(
    "/pools",
    response_model=list[PoolView],
    summary="Warm pools: each one's target, workers, cost and hits and misses",
    responses=errors(503),
)
async def list_pools(service: ServiceDep) -> JSONResponse:
    return JSONResponse(await service.pool_view())


@router.get(
    "/line",
    response_model=list[Waiting],
    summary="The callers waiting in line, in admission order",
    responses=errors(503),
)
async def waiting_line(service: ServiceDep) -> JSONResponse:
    return JSONResponse(await service.waiting_line())
