"""Who follows a lease as its life changes (`GET /v1/lease/{id}/events`,
docs/concepts/lease-events.md#the-stream): one event per change, the first the lease as it
is now, the last its end.

A change is seen two ways, because any replica may make it:

- This process's own moves wake its followers at once: each part of the service calls
  `changed(lease_id)` after a guarded move it made (a renewal, a release claimed or
  finished, a preemption, a worker lost, an expiry or a preemption's deadline ended here).
- Another replica's moves cannot wake this process (the store is shared, PostgreSQL), nor
  can the moves it makes without a call here (an acquire's provision turning `active`): so
  each follower also re-reads its lease's row every REREAD_S. A preemption made elsewhere is
  then heard within a second, well inside any grace (seconds to minutes), for one read by
  primary key per follower per second.

The moves between two reads collapse into one event (two renewals are one `renewed`, with
the later `expires_at`); a state a lease passes through unseen (`releasing`) is no event of
its own. Followers end when the process drains (`close`), so that a stream holds no drain
up: its client comes back, to a replica that is ready."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from openalice_scheduler.errors import SchedulerError
from openalice_scheduler.models import LeaseState
from openalice_scheduler.store import LeaseRecord

# How often a follower re-reads its lease's row, for what another replica changed.
REREAD_S = 1.0
# The events after which a lease changes no more: the stream ends with them.
ENDS = (LeaseState.released.value, LeaseState.failed.value)


@dataclass(frozen=True, slots=True)
class LeaseEvent:
    """`name`: the lease's state as the event names it (`active`, `preempting`,
    `renewed`, `released`; `failed` for a provision that failed); `lease`: the lease then."""

    name: str
    lease: LeaseRecord


class Watching:
    """This process's followers, by lease id: `changed` wakes those of a lease."""

    def __init__(self) -> None:
        self._followers: dict[str, set[asyncio.Event]] = {}
        self.closed = False

    def changed(self, lease_id: str) -> None:
        """This process just moved `lease_id`: its followers read it again now."""
        for wake in self._followers.get(lease_id, ()):
            wake.set()

    def close(self) -> None:
        """Draining: every follower ends, and none begins (the service refuses them)."""
        self.closed = True
        for followers in self._followers.values():
            for wake in followers:
                wake.set()

    async def follow(
        self,
        first: LeaseRecord,
        read: Callable[[], Awaitable[LeaseRecord | None]],
        *,
        quiet: float,
    ) -> AsyncIterator[LeaseEvent | None]:
        """The events of `first`'s lease from now on, `read` giving its row again; None
        after `quiet` seconds without one (the route's keep-alive). Ends after the
        lease's end, when the lease is no longer found (purged), or at `close`."""
        wake = asyncio.Event()
        followers = self._followers.setdefault(first.lease_id, set())
        followers.add(wake)
        try:
            seen: LeaseRecord | None = None
            record: LeaseRecord | None = first
            said = time.monotonic()
            while record is not None and not self.closed:
                name = _change(seen, record)
                if name is not None:
                    yield LeaseEvent(name, record)
                    if name in ENDS:
                        return
                    seen, said = record, time.monotonic()
                elif time.monotonic() - said >= quiet:
                    yield None
                    said = time.monotonic()
                wait = min(REREAD_S, max(0.0, quiet - (time.monotonic() - said)))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await wake.wait()
                wake.clear()
                if self.closed:
                    return
                with contextlib.suppress(SchedulerError):  # store down: the next read
                    record = await read()
        finally:
            followers.discard(wake)
            if not followers:
                self._followers.pop(first.lease_id, None)


def _change(seen: LeaseRecord | None, now: LeaseRecord) -> str | None:
    """The event that `now` is after `seen` (None: nothing sent yet), if any."""
    state = now.state
    if state in ENDS:
        return str(state)
    if state == LeaseState.preempting:
        return None if seen is not None and seen.state == state else "preempting"
    if state == LeaseState.active:
        if seen is None:
            return "active"
        if seen.state == state and seen.expires_at != now.expires_at:
            return "renewed"
    # Not yet handed out (`provisioning`), or on its way out (`releasing`): no event.
    return None
