"""A lease's events as they happen (`GET /v1/lease/{id}/events`,
docs/concepts/lease-events.md#the-stream): a server-sent event stream over the service's
`events`, one event per change of the lease's life, its data the `Lease` as
`GET /v1/lease/{id}` answers it.

The stream ends after the lease's end, when the caller hangs up (Starlette's streaming
response cancels the stream when the server tells it of the disconnect), and when the
scheduler drains (the service ends its followers)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Security
from fastapi.responses import StreamingResponse

from openalice_scheduler.api.deps import SECRET_HEADER, LeaseOwner, ServiceDep
from openalice_scheduler.api.openapi import errors
from openalice_scheduler.lifecycle.watching import LeaseEvent

router = APIRouter(prefix="/v1", tags=["leases"], dependencies=[Security(SECRET_HEADER)])

# A comment line this often while nothing happens, so that proxies (and load balancers
# with an idle timeout, often 30-60 s) keep the connection open.
KEEP_ALIVE_S = 15.0


@router.get(
    "/lease/{lease_id}/events",
    # No media type on the class: the error answers are documented as JSON, the 200 as
    # the event stream it is (`responses`).
    response_class=StreamingResponse,
    summary="Follow a lease: one server-sent event per change of its life",
    responses={
        200: {
            "description": "`text/event-stream`: `event:` the lease's state (`active`, "
            "`preempting`, `renewed`, `released`), `data:` the Lease as JSON; the first "
            "event is the lease as it is now, the stream ends after `released`; a "
            "`: keep-alive` comment every 15 s",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
        **errors(403, 404, 422, 503),
    },
)
async def lease_events(
    lease_id: str, service: ServiceDep, owner: LeaseOwner = None
) -> StreamingResponse:
    events = await service.events(lease_id, owner, quiet=KEEP_ALIVE_S)
    # No caching, and no buffering by a proxy (nginx's header): each event as it comes.
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(_frames(events), media_type="text/event-stream", headers=headers)


async def _frames(events: AsyncIterator[LeaseEvent | None]) -> AsyncIterator[bytes]:
    async for event in events:
        if event is None:
            yield b": keep-alive\n\n"
            continue
        data = json.dumps(event.lease.wire(), separators=(",", ":"))
        yield f"event: {event.name}\ndata: {data}\n\n".encode()
