"""The guards' poll (README, The guard): gated by the secret like every /v1 route."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Security
from fastapi.responses import JSONResponse

from openalice_scheduler.api.deps import SECRET_HEADER, ServiceDep
from openalice_scheduler.api.openapi import errors
from openalice_scheduler.models import GuardPoll, Token

router = APIRouter(prefix="/v1", tags=["guard"], dependencies=[Security(SECRET_HEADER)])


@router.get(
    "/guard",
    response_model=GuardPoll,
    summary="A guard's poll: its contact recorded, every live worker's deadline",
    responses=errors(422, 503),
)
async def guard_poll(
    service: ServiceDep,
    guard_id: Annotated[Token, Query(description="The guard's name (GUARD_ID)")],
    providers: Annotated[
        str,
        Query(
            max_length=256,
            pattern=r"^[a-z0-9-]+(,[a-z0-9-]+)*$",
            description="Comma list of the providers the guard watches",
        ),
    ],
) -> JSONResponse:
    assert service.guards is not None  # set before serving (lifespan)
    return JSONResponse(
        await service.guards.poll(guard_id, tuple(providers.split(",")), service.now_us())
    )
