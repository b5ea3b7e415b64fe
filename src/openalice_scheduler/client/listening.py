"""What `lease()` hears while it holds a lease, for both clients: the lease's event stream
(`GET /v1/lease/{id}/events`, docs/concepts/lease-events.md#in-the-clients), read as
server-sent events, and what each event means for the `HeldLease`: `preempting` is the
notice (`on_preempt`, at once, long before the next renewal would have heard it),
`released` (or `failed`) the lease's end under the holder (`on_lost`); the others keep
`held.lease` current.

The stream is followed until the lease ends or the block does; one that drops (a network
fault, a scheduler draining, a proxy's idle timeout) is opened again after a backoff,
and its first event is then the lease as it is, so nothing that happened meanwhile is
missed. Answers that will not change (the lease is unknown, another owner's, the secret
wrong) end the listening: renewals still run, and still hear what they hear."""

from __future__ import annotations

import logging

import httpx
from pydantic import ValidationError

from openalice_scheduler.client.renewal import HeldLease, _ended, _preempted
from openalice_scheduler.errors import (
    Forbidden,
    InvalidRequest,
    LeaseNotFound,
    SchedulerError,
    Unauthorized,
)
from openalice_scheduler.models import Lease

log = logging.getLogger(__name__)

# The server sends a comment every 15 s when nothing happens: three missed and the
# stream is taken for dead, and opened again.
READ_TIMEOUT_S = 45.0
# Between two attempts to open the stream: doubling from the first, up to the most.
RECONNECT_FIRST_S = 0.5
RECONNECT_MOST_S = 15.0


def stream_timeout(connect: float) -> httpx.Timeout:
    return httpx.Timeout(connect, read=READ_TIMEOUT_S)


class EventReader:
    """Server-sent events, line by line (the WHATWG format, as the scheduler writes it):
    `line` returns (event, data) when a blank line ends one; comments are skipped."""

    def __init__(self) -> None:
        self._name = ""
        self._data: list[str] = []

    def line(self, line: str) -> tuple[str, str] | None:
        if not line:
            event = (self._name or "message", "\n".join(self._data)) if self._data else None
            self._name, self._data = "", []
            return event
        if line.startswith(":"):
            return None  # a comment: the keep-alive
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            self._name = value
        elif field == "data":
            self._data.append(value)
        return None


def heard(held: HeldLease, name: str, data: str) -> bool:
    """What the event `name` (its `data`, a Lease) means for `held`; whether the lease
    has ended (the stream then ends too)."""
    try:
        lease = Lease.model_validate_json(data)
    except ValidationError:
        log.warning("lease %s: an event %r that is not a lease; ignored", held.lease_id, name)
        return False
    if name in ("released", "failed"):
        _ended(held, lease)
        return True
    held.lease = lease
    if name == "preempting":
        _preempted(held, lease)
    return False


def gives_up(held: HeldLease, exc: SchedulerError) -> bool:
    """Whether an error answer to opening the stream ends the listening (it would be the
    same again); any other is tried again after the backoff."""
    if isinstance(exc, LeaseNotFound | Forbidden | Unauthorized | InvalidRequest):
        log.warning(
            "lease %s: its events cannot be followed (%s); renewals go on",
            held.lease_id,
            exc.code,
        )
        return True
    return False


def next_backoff(backoff: float) -> float:
    return min(backoff * 2, RECONNECT_MOST_S)
