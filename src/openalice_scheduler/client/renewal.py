"""What `lease()` does around the caller's block, for both clients: the `HeldLease` it
yields, how often renewals run and are retried, which renewal failures end them (the lease
is gone, or the scheduler refuses), what happens when the lease is found gone (the
`on_lost` callback) or being preempted (the `on_preempt` callback, each once, whoever hears
it first: a renewal or the lease's event stream, listening.py), and which release outcomes
leave nothing to do. A release that fails while the block's own exception propagates is
logged here, not raised."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from openalice_scheduler.errors import (
    Forbidden,
    InvalidRequest,
    LeaseNotFound,
    Preempting,
    ReleaseFailed,
    SchedulerError,
    Unauthorized,
    WorkerLost,
)
from openalice_scheduler.models import Lease, LeaseState, ReleaseReason

log = logging.getLogger(__name__)

# After a failed renewal, try again sooner than the regular third of the TTL.
RENEW_RETRY_MAX_S = 30.0

OnLost = Callable[[str, str], object]
"""`on_lost(lease_id, reason)`, see `HeldLease`."""


@dataclass(frozen=True)
class PreemptNotice:
    """What `on_preempt` is told: the lease being preempted, when its worker goes
    (`preempt_at`, RFC 3339), and the lease as the scheduler then showed it."""

    lease_id: str
    preempt_at: str | None
    lease: Lease


OnPreempt = Callable[[PreemptNotice], object]
"""`on_preempt(notice)`, see `HeldLease`."""


class HeldLease:
    """A lease held by `lease()`, kept fresh by its renewals. `lost` turns true when the
    scheduler ended the lease (a renewal answered 404): the worker is gone, stop using it;
    or when it preempts it for a caller of a higher class (409 `preempting`): the worker
    goes at `lease.preempt_at`, so save what you can and let go
    (docs/concepts/priorities.md#priorities-and-preemption); or when its worker stopped after its
    hand-out (409 `worker_lost`): `lease.lost_cause` and `lease.exit_code` say why
    (docs/concepts/readiness-and-loss.md#a-worker-lost-after-its-hand-out). Either way it is no
    longer renewed.

    Then `on_lost(lease_id, reason)` is called, once, if given: from the renewal thread of
    `SchedulerClient`, or in the event loop (the renewal task) of `AsyncSchedulerClient`;
    an exception it raises is logged. `reason` is the lease's `release_reason` as the
    scheduler then tells it (`explicit`: released by someone else, `expired`, `lost`: its
    worker stopped or vanished, `orphan`, `failed`, `preempted`: being or been preempted), else its
    state (`releasing`), else
    `lease_not_found` when the scheduler no longer knows the lease at all.

    While `lease()` listens to the lease's event stream (`listen=True`, the default;
    docs/concepts/lease-events.md#in-the-clients), a preemption is heard the moment it is made,
    not at the next renewal: `preempting` turns true, `preempt_at` says when the worker goes,
    and `on_preempt(notice)` (a `PreemptNotice`) is called at once, once, from the listening
    thread or task (or from the renewal that heard it first). Finish or save what you can
    and leave the block: its release frees the room for the preemptor at once. Renewals
    stop (a preempted lease is not renewed); `on_lost` is then called when the lease ends
    under the holder (at `preempt_at`, reason `preempted`), as for any other end the stream
    tells (`released`, with `lease.release_reason`, `lease.lost_cause`)."""

    def __init__(
        self, lease: Lease, on_lost: OnLost | None = None, on_preempt: OnPreempt | None = None
    ) -> None:
        self.lease = lease
        self.renewals = 0
        self.lost = False
        self.lost_reason: str | None = None
        self.error: SchedulerError | None = None  # last renewal failure; None after a success
        self.on_lost = on_lost
        self.preempting = False
        self.preempt_at: str | None = None
        self.on_preempt = on_preempt
        # The renewal and the listener may both hear an end: the callbacks run once.
        self._once = threading.Lock()
        self._told: set[str] = set()

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
        return (
            f"HeldLease(lease_id={self.lease_id!r}, endpoint={self.endpoint!r}, "
            f"expires_at={self.expires_at!r}, renewals={self.renewals}, lost={self.lost}, "
            f"preempting={self.preempting})"
        )

    def _first(self, what: str) -> bool:
        """Whether this is the first time `what` (lost, preempted) is told."""
        with self._once:
            if what in self._told:
                return False
            self._told.add(what)
            return True


class LeaseLost(LeaseNotFound):
    """Raised by `AsyncSchedulerClient.lease(..., cancel_on_lost=True)` when the lease
    ended while the block ran and the block was cancelled for it. A `LeaseNotFound`, so
    `except LeaseNotFound` still catches it; `reason` as for `on_lost`."""

    code = "lease_lost"

    def __init__(self, lease_id: str, reason: str) -> None:
        super().__init__(
            f"lease {lease_id} ended on the scheduler while held ({reason})",
            lease_id=lease_id,
            reason=reason,
        )
        self.lease_id = lease_id
        self.reason = reason


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
    if isinstance(exc, Preempting):
        # Before `lost`: whoever sees it lost also sees it preempting (and releases it).
        preempt_at = exc.details.get("preempt_at")
        held.preempt_at = preempt_at if isinstance(preempt_at, str) else None
        held.preempting = True
    if isinstance(exc, LeaseNotFound | Preempting | WorkerLost):
        held.lost = True
        log.warning(
            "lease %s ended on the scheduler (%s); no longer renewed", held.lease_id, exc.message
        )
        return False
    if isinstance(exc, Unauthorized | Forbidden | InvalidRequest):
        log.warning("lease %s: renewal refused (%s); no longer renewed", held.lease_id, exc.code)
        return False
    log.warning("lease %s: renewal failed (%s); retrying", held.lease_id, exc.code)
    return True


def _lost(held: HeldLease, found: Lease | None) -> None:
    """The lease is gone (a renewal answered 404); `found` is what a lookup then returned,
    None if it failed. Called once, from the renewal thread or task."""
    if found is not None:
        held.lease = found
    if isinstance(held.error, Preempting):
        reason = ReleaseReason.preempted.value  # its worker still runs, until preempt_at
        preempt_at = held.error.details.get("preempt_at")
        _preempted(held, held.lease, preempt_at if isinstance(preempt_at, str) else None)
    elif isinstance(held.error, WorkerLost):
        reason = ReleaseReason.lost.value  # its worker stopped: `lease.lost_cause` says why
    elif found is not None:
        reason = (found.release_reason or found.state).value
    else:
        reason = LeaseNotFound.code
    _tell_lost(held, reason)


def _ended(held: HeldLease, lease: Lease) -> None:
    """The lease's event stream told its end (`lease`) while the block held it."""
    held.lease = lease
    held.lost = True
    _tell_lost(held, (lease.release_reason or lease.state).value)


def _tell_lost(held: HeldLease, reason: str) -> None:
    if not held._first("lost"):
        return
    held.lost_reason = reason
    if held.on_lost is None:
        return
    try:
        held.on_lost(held.lease_id, reason)
    except Exception:
        log.exception("lease %s: the on_lost callback raised", held.lease_id)


def _preempted(held: HeldLease, lease: Lease, preempt_at: str | None = None) -> None:
    """The lease is being preempted (`lease`, as last seen): `on_preempt`, once."""
    if not held._first("preempted"):
        return
    held.preempt_at = lease.preempt_at or preempt_at or held.preempt_at
    held.preempting = True
    log.warning(
        "lease %s is being preempted; its worker goes at %s", held.lease_id, held.preempt_at
    )
    if held.on_preempt is None:
        return
    try:
        held.on_preempt(PreemptNotice(held.lease_id, held.preempt_at, lease))
    except Exception:
        log.exception("lease %s: the on_preempt callback raised", held.lease_id)


def _keeps_renewing(held: HeldLease) -> bool:
    """Whether renewals go on: not once the lease is lost or being preempted (a preempted
    lease is not renewed)."""
    return not (held.lost or held.preempting)


def _needs_release(held: HeldLease) -> bool:
    """Whether the block's end must release the lease: not when it has ended already,
    but a lease being preempted, yes (its room is then the preemptor's at once)."""
    if held.lease.state in (LeaseState.released, LeaseState.failed):
        return False
    return held.preempting or not held.lost


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
        log.warning(
            "lease %s: %s failed (%s: %s); it ends at its expiry",
            held.lease_id,
            what,
            exc.code,
            exc.message,
        )


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    # wait(), not `await task`: a cancellation of the caller itself must still come through.
    await asyncio.wait([task])
    if not task.cancelled() and task.exception() is not None:
        log.error("lease task %s crashed", task.get_name(), exc_info=task.exception())
