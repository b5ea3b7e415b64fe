"""What `lease()` does around the caller's block, for both clients: the `HeldLease` it
yields, how often renewals run and are retried, which renewal failures end them (the lease
is gone, or the scheduler refuses), and which release outcomes leave nothing to do. A
release that fails while the block's own exception propagates is logged here, not raised."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from openalice_scheduler.errors import (
    Forbidden,
    InvalidRequest,
    LeaseNotFound,
    ReleaseFailed,
    SchedulerError,
    Unauthorized,
)
from openalice_scheduler.models import Lease

log = logging.getLogger(__name__)

# After a failed renewal, try again sooner than the regular third of the TTL.
RENEW_RETRY_MAX_S = 30.0


class HeldLease:
    """A lease held by `lease()`, kept fresh by its renewals. `lost` turns true when the
    scheduler ended the lease (a renewal answered 404): the worker is gone, stop using it."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.renewals = 0
        self.lost = False
        self.error: SchedulerError | None = None  # last renewal failure; None after a success

    @property
    def lease_id(self) -> str:
        return self.lease.lease_id

    @property
    def endpoint(self) -> str:
        return self.lease.endpoint

    @property
    def expires_at(self) -> str:
        return self.lease.expires_at

    def __repr__(self) -> str:
        return (f"HeldLease(lease_id={self.lease_id!r}, endpoint={self.endpoint!r}, "
                f"expires_at={self.expires_at!r}, renewals={self.renewals}, lost={self.lost})")


def _renew_every(ttl: int) -> float:
    return ttl / 3


def _retry_every(ttl: int) -> float:
    return min(ttl / 9, RENEW_RETRY_MAX_S)


def _renewed(held: HeldLease) -> None:
    held.renewals += 1
    held.error = None


def _renewal_failed(held: HeldLease, exc: SchedulerError) -> bool:
    """Record a failed renewal; whether to keep trying (only errors that may pass do)."""
    held.error = exc
    if isinstance(exc, LeaseNotFound):
        held.lost = True
        log.warning("lease %s ended on the scheduler (%s); no longer renewed",
                    held.lease_id, exc.message)
        return False
    if isinstance(exc, Unauthorized | Forbidden | InvalidRequest):
        log.warning("lease %s: renewal refused (%s); no longer renewed", held.lease_id, exc.code)
        return False
    log.warning("lease %s: renewal failed (%s); retrying", held.lease_id, exc.code)
    return True


@contextlib.contextmanager
def _release_done() -> Iterator[None]:
    """Release outcomes that leave nothing to do: already ended (404), or the provider
    failed and the scheduler keeps retrying on its own (502 release_failed)."""
    try:
        yield
    except LeaseNotFound:
        pass
    except ReleaseFailed as exc:
        log.warning("release failed on the provider (%s); the scheduler retries it", exc.message)


@contextlib.contextmanager
def _logged(held: HeldLease, what: str) -> Iterator[None]:
    # While the block's own exception propagates, a failing release must not replace it.
    try:
        yield
    except SchedulerError as exc:
        log.warning("lease %s: %s failed (%s: %s); it ends at its expiry", held.lease_id, what,
                    exc.code, exc.message)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    # wait(), not `await task`: a cancellation of the caller itself must still come through.
    await asyncio.wait([task])
    if not task.cancelled() and task.exception() is not None:
        log.error("lease renewal task crashed", exc_info=task.exception())
