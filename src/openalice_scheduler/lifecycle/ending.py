"""How a lease ends: claim `releasing` → destroy → record `released`, or keep
`releasing` with a retry time when the provider could not confirm; and the ends the
loops find and hand over (an expiry, a release to retry, a provision abandoned, an
orphan worker). A worker lost after its hand-out is losing.py's."""

from __future__ import annotations

import asyncio
import logging

from opentelemetry.trace import Status, StatusCode

from openalice_scheduler.errors import (
    LeaseConflict,
    LeaseNotFound,
    ProviderError,
    ReleaseFailed,
)
from openalice_scheduler.ids import is_lease_id
from openalice_scheduler.lifecycle import states
from openalice_scheduler.lifecycle.admission import check_owner
from openalice_scheduler.lifecycle.core import Core
from openalice_scheduler.lifecycle.watching import Watching
from openalice_scheduler.logs import lease_ref
from openalice_scheduler.models import LeaseState, ReleaseReason
from openalice_scheduler.providers import Provider
from openalice_scheduler.store import LeaseRecord
from openalice_scheduler.store.leases import Check
from openalice_scheduler.tracing import span_attributes

# The service's lines, as ever (operators filter by logger name).
log = logging.getLogger("openalice_scheduler.service")
MAX_PARALLEL_RELEASES = 16  # worker destructions the sweeper runs at once

RETRY_BACKOFF_CAP_S = 30.0


class Ending:
    """Release, expiry and destruction of leases."""

    def __init__(self, core: Core, watching: Watching) -> None:
        self.core = core
        self.watching = watching  # told of each lease this moves
        self._releases = asyncio.Semaphore(MAX_PARALLEL_RELEASES)
        self._telling: set[asyncio.Task[None]] = set()  # preemption notices under way

    # --- release ---------------------------------------------------------------------

    async def release(self, lease_id: str, owner: str | None) -> None:
        """Release a lease the caller holds: its worker is destroyed before this returns
        (ReleaseFailed when the provider could not confirm: it is retried)."""
        if not is_lease_id(lease_id):
            raise LeaseNotFound(f"no lease {lease_id[:64]!r}")

        def check(record: LeaseRecord | None) -> None:
            # Runs in the claiming transaction: what it checks cannot change meanwhile.
            if record is None:
                raise LeaseNotFound(f"no lease {lease_id!r}")
            if record.state in (LeaseState.released, LeaseState.failed):
                raise LeaseNotFound(f"lease {lease_id} is already released")
            check_owner(record, owner)
            if record.state == LeaseState.provisioning:
                raise LeaseConflict(
                    f"lease {lease_id} is still provisioning; release it once acquired"
                )

        error = await self.end(lease_id, check)
        if error is not None:
            raise ReleaseFailed(
                f"{error[0]} could not destroy the worker of lease {lease_id}: {error[1]}; "
                "the lease stays releasing and the scheduler keeps retrying",
                lease_id=lease_id,
                provider=error[0],
            )

    async def end(
        self, lease_id: str, check: Check | None, reason: ReleaseReason = ReleaseReason.explicit
    ) -> tuple[str, str] | None:
        """Claim the lease and destroy its worker; (provider, why) when it could not."""
        claimed = await self.core.store.claim_release(
            lease_id,
            reason,
            states.RELEASE,
            now=self.core.now_us(),
            check=check,
            at_once=(states.RELEASE_AT_ONCE, self.core.instant),
        )
        if claimed is None:
            raise LeaseNotFound(f"lease {lease_id} is already released")
        self.watching.changed(lease_id)
        if claimed.state == LeaseState.released:  # nothing to destroy
            self._released(claimed)
            return None
        error = await self.destroy(claimed)
        return None if error is None else (claimed.provider, error)

    async def release_due(self, limit: int = 100) -> int:
        """Release every lease whose time has come: expired ones, and releases whose
        retry is due. Returns how many were claimed."""
        await self._settle_unsure()
        now = self.core.now_us()
        claimed = await self.core.store.claim_expired(states.EXPIRE, now=now, limit=limit)
        claimed += await self.core.store.claim_preempted(states.PREEMPTED, now=now, limit=limit)
        claimed += await self.core.store.claim_retries(states.RETRY, now=now, limit=limit)
        await asyncio.gather(*(self._destroy_due(record) for record in claimed))
        return len(claimed)

    async def _settle_unsure(self) -> None:
        """A lease whose acquire answered 503 (the store's answer lost) but was committed
        all the same is released: its caller was told no. One an idempotent retry finds
        again (owner_id and correlation_id) is left to that retry, and to its TTL."""
        for lease_id in list(self.core.store.unsure):
            record = await self.core.store.get(lease_id)  # store still down: next time
            self.core.store.unsure.discard(lease_id)
            if (
                record is not None
                and record.state == LeaseState.active
                and not (record.owner_id and record.correlation_id)
            ):
                log.warning(
                    "lease %s: recorded although its acquire answered 503; releasing it",
                    lease_ref(record),
                )
                await self.end(lease_id, None, ReleaseReason.failed)

    async def _destroy_due(self, record: LeaseRecord) -> None:
        async with self._releases:
            if record.release_reason == ReleaseReason.expired.value and not record.release_attempts:
                log.info("lease %s expired; releasing", lease_ref(record))
            if record.release_reason == ReleaseReason.preempted.value:
                log.info("lease %s preempted: its grace is over; releasing", lease_ref(record))
            await self.destroy(record)

    async def destroy(self, record: LeaseRecord) -> str | None:
        """Destroy a claimed `releasing` lease's worker and record the outcome. Returns
        None when done, or why the provider could not confirm (a retry is scheduled)."""
        attributes = span_attributes(
            record.lease_id, record.provider, record.kind, record.correlation_id
        )
        with self.core.tracer.start_as_current_span("release", attributes=attributes) as span:
            provider = self.core.by_name.get(record.provider)
            try:
                if provider is None:
                    raise ProviderError(f"provider {record.provider!r} is not configured")
                await provider.release(record.provider_token, record.lease_id)
            except ProviderError as exc:
                span.set_status(Status(StatusCode.ERROR, exc.message))
                attempts = record.release_attempts + 1
                retry_at = self.core.now_us() + int(_backoff(attempts) * 1e6)
                await self.core.store.release_attempt_failed(
                    record.lease_id,
                    states.ATTEMPT_FAILED,
                    error=exc.message,
                    retry_at=retry_at,
                    now=self.core.now_us(),
                )
                self.core.metrics.release_failures.labels(record.provider).inc()
                self.core.on_due(retry_at)
                log.warning(
                    "lease %s: release attempt %d on %s failed: %s",
                    lease_ref(record),
                    attempts,
                    record.provider,
                    exc.message,
                )
                return exc.message
        done = await self.core.store.finish_release(
            record.lease_id, states.FINISH, now=self.core.now_us()
        )
        self.watching.changed(record.lease_id)
        if done is None:
            self.core.capacity_freed()
        else:
            self._released(done)
        return None

    def _released(self, record: LeaseRecord) -> None:
        self.core.capacity_freed()
        reason = record.release_reason or ReleaseReason.explicit.value
        self.core.metrics.released.labels(record.provider, reason).inc()
        self.core.metrics.spent(record)
        log.info("lease %s released (%s)", lease_ref(record), reason)

    # --- preemption -------------------------------------------------------------------

    def preempted(self, victim: LeaseRecord, by_class: str) -> None:
        """`victim` was just displaced (`preempting`) for a caller of `by_class`: counted,
        its end made due at `preempt_at`, and its worker told at once, in the background
        (best effort: the lease's own `GET …/self` says so too)."""
        assert victim.preempt_at is not None
        self.core.metrics.preemptions.labels(victim.priority_class).inc()
        self.core.on_due(victim.preempt_at)
        self.watching.changed(victim.lease_id)
        log.info(
            "lease %s (class %s) preempted for a caller of class %s; its worker goes at %s",
            lease_ref(victim),
            victim.priority_class,
            by_class,
            victim.wire()["preempt_at"],
        )
        notices = self.core.notices
        if notices is not None:
            task = asyncio.get_running_loop().create_task(self._tell(victim))
            self._telling.add(task)
            task.add_done_callback(self._telling.discard)

    async def _tell(self, victim: LeaseRecord) -> None:
        assert self.core.notices is not None
        outcome = await self.core.notices.preempt(victim)
        if not outcome.ok:
            log.warning(
                "lease %s: its worker was not told of its preemption (%s)",
                lease_ref(victim),
                outcome.problem,
            )

    # --- reconciliation: what the reconciler found, resolved ----------------------------

    async def recover_after_restart(self) -> None:
        """Before serving, in a store no other process uses: release claims found are
        a stopped process's, and are due now."""
        await self.core.store.recover_claims(now=self.core.now_us())

    async def fail_abandoned(self, provider: Provider, record: LeaseRecord) -> bool:
        """A provision that will never finish (its scheduler stopped): recorded `failed`
        first, by a guarded update, and only then its worker destroyed. Should the
        acquire still run after all, its `activate` finds the lease resolved and
        destroys its own worker: never is a worker destroyed under an active lease. A
        worker left here (provider error) is an orphan for the next pass."""
        failed = await self.core.store.fail(
            record.lease_id,
            states.FAIL,
            error="scheduler stopped while provisioning",
            now=self.core.now_us(),
        )
        if failed is None:
            return False
        self.watching.changed(record.lease_id)
        self.core.metrics.released.labels(provider.name, ReleaseReason.failed.value).inc()
        self.core.capacity_freed()
        log.warning(
            "lease %s: provision abandoned on %s; marked failed", lease_ref(record), provider.name
        )
        await provider.release("", record.lease_id)
        return True

    async def destroy_orphan(self, provider: Provider, lease_id: str, token: str) -> None:
        """A worker of this scheduler that no live lease holds."""
        await provider.release(token, lease_id)
        self.core.metrics.released.labels(provider.name, ReleaseReason.orphan.value).inc()
        log.info(
            "reconcile: destroyed orphan worker %s of lease %s on %s",
            token[:12],
            lease_ref(lease_id),
            provider.name,
        )


def _backoff(attempts: int) -> float:
    return float(min(RETRY_BACKOFF_CAP_S, 2 ** (attempts - 1)))  # 1, 2, 4 ... 30 s
