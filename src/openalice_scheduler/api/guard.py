"""The guards' poll (docs/concepts/guard.md#the-guard): gated by the secret like every /v1 route."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Security
from fastapi.responses import JSONResponse

from openalice_scheduler.api.deps import SECRET_HEADER, ServiceDep
from openalice_scheduler.api.openapi import Responses, errors
from openalice_scheduler.models import ErrorBody, GuardPoll, Token

router = APIRouter(prefix="/v1", tags=["guard"], dependencies=[Security(SECRET_HEADER)])

_TOO_MANY: Responses = {
    429: {
        "model": ErrorBody,
        "description": "`too_many_guards`: a guard not recorded yet, while as many are as "
        "MAX_GUARDS allows (`limit`); known guards poll on",
        "headers": errors(429)[429]["headers"],
    }
}


@router.get(
    "/guard",
    response_model=GuardPoll,
    summary="A guard's poll: its contact recorded, every live worker's deadline",
    responses={**errors(422, 503), **_TOO_MANY},
)
async def guard_poll(
    service: ServiceDep,
    guard_id: Annotated[Token, Query(description="The guard's name (GUARD_ID)")],
    providers: Annotated[
        str,
        Query(
            max_length=256,
            pattern=r"^[a-z0-9-]+(,[a-z0-9-]+)*$",
            description="Comma list of the providers the guard watches, each one of "
            "this scheduler's (PROVIDERS; another is a 422 naming the valid ones)",
        ),
    ],
) -> JSONResponse:
    assert service.guards is not None  # set before serving (lifespan)
    return JSONResponse(
        await service.guards.poll(guard_id, tuple(providers.split(",")), service.now_us())
    )
