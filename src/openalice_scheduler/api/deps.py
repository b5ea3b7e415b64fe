"""Request dependencies as Annotated aliases, so routes stay one-liners."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.security import APIKeyHeader

from openalice_scheduler.lifecycle import LeaseService


async def _service(request: Request) -> LeaseService:
    # async: FastAPI runs a plain `def` dependency on a worker thread, per request.
    service: LeaseService = request.app.state.service  # set by the lifespan
    return service


ServiceDep = Annotated[LeaseService, Depends(_service)]
# The secret of the gated /v1 routes. Enforced by SecretGate before routing (so even a
# malformed body gets 401 first); each gated router declares it, so that /openapi.json
# shows the requirement.
SECRET_HEADER = APIKeyHeader(name="X-Internal-Secret", auto_error=False)
LeaseOwner = Annotated[
    str | None,
    Header(alias="X-Lease-Owner", description="Must equal the lease's owner_id when it has one."),
]
