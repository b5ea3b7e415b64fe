"""`GET /v1/lease/{id}/self`: a worker asks whether its own lease still holds
(docs/concepts/worker-self.md#what-a-worker-knows-of-its-lease). SecretGate (middleware.py) lets
this one path through with the lease's own token (`Authorization: Bearer`, lease_access.py) instead
of the internal secret, and refuses a token of another lease (403); so the route sees only callers
entitled to this lease."""

from __future__ import annotations

from fastapi import APIRouter, Security
from fastapi.responses import JSONResponse
from fastapi.security import HTTPBearer

from openalice_scheduler.api.deps import SECRET_HEADER, ServiceDep
from openalice_scheduler.api.openapi import Responses, errors
from openalice_scheduler.models import ErrorBody, LeaseSelf
from openalice_scheduler.times import format_us

# Either one (OpenAPI lists them as alternatives); checked by SecretGate before routing.
_token = HTTPBearer(auto_error=False, description="LEASE_TOKEN: the lease's own token")
router = APIRouter(
    prefix="/v1", tags=["workers"], dependencies=[Security(SECRET_HEADER), Security(_token)]
)

_FORBIDDEN: Responses = {
    403: {"model": ErrorBody, "description": "`forbidden`: the bearer token is not this lease's"}
}


@router.get(
    "/lease/{lease_id}/self",
    response_model=LeaseSelf,
    summary="For a lease's worker: its lease's state, expires_at and fence",
    responses={**errors(401, 404, 422, 503), **_FORBIDDEN},
)
async def lease_self(lease_id: str, service: ServiceDep) -> JSONResponse:
    record = await service.get(lease_id)
    return JSONResponse(
        {
            "lease_id": record.lease_id,
            "state": record.state,
            "expires_at": format_us(record.expires_at),
            "fence": record.fence,
            "preempt_at": None if record.preempt_at is None else format_us(record.preempt_at),
        }
    )
