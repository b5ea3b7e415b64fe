"""LeaseService: the lifecycle rules of the contract live here and only here.

acquire: record `provisioning` → pick a provider → provision (outside any transaction)
→ record `active`. release: claim `releasing` → destroy → record `released`, or keep
`releasing` with a retry time when the provider could not confirm."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from opentelemetry.trace import Status, StatusCode, Tracer

from openalice_scheduler.errors import (
    Forbidden,
    LeaseConflict,
    LeaseNotFound,
    NoProviderAvailable,
    ProviderError,
    ProvisionFailed,
    ReleaseFailed,
)
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.models import LeaseRequest, LeaseState, ReleaseReason
from openalice_scheduler.policy import OrderedFirstAvailable
from openalice_scheduler.providers import Provider, WorkerSpec
from openalice_scheduler.store import AtCapacity, LeaseRecord, LeaseStore, NewLease, to_us

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]
RETRY_BACKOFF_CAP_S = 30.0


def utcnow() -> datetime:
    return datetime.now(UTC)


class LeaseService:
    def __init__(
        self,
        store: LeaseStore,
        providers: Sequence[Provider],
        policy: OrderedFirstAvailable,
        metrics: Metrics,
        tracer: Tracer,
        *,
        provision_timeout: float = 600.0,
        clock: Clock = utcnow,
    ) -> None:
        self.store = store
        self.providers = list(providers)
        self.by_name = {p.name: p for p in self.providers}
        self.policy = policy
        self.metrics = metrics
        self.tracer = tracer
        self.provision_timeout = provision_timeout
        self.clock = clock
        # Leases this process is provisioning right now: the reconciler leaves them be.
        self.in_flight: set[str] = set()
        # Called with the moment (µs) something new becomes due; the sweeper listens.
        self.on_due: Callable[[int], None] = lambda _at: None

    def now_us(self) -> int:
        return to_us(self.clock())

    # --- acquire ---------------------------------------------------------------------

    async def acquire(self, request: LeaseRequest) -> LeaseRecord:
        lease_id = str(uuid.uuid4())
        now = self.clock()
        spec = WorkerSpec(
            lease_id=lease_id,
            kind=request.kind,
            gpu=request.gpu,
            expires_at=now + timedelta(seconds=request.ttl_seconds),
            owner_id=request.owner_id,
            correlation_id=request.correlation_id,
            region=request.region,
            env=request.env,
        )
        new = NewLease(
            lease_id=lease_id,
            kind=request.kind.value,
            gpu=request.gpu.value,
            owner_id=request.owner_id,
            correlation_id=request.correlation_id,
            region=request.region,
            ttl_seconds=request.ttl_seconds,
            created_at=to_us(now),
            expires_at=to_us(spec.expires_at),
        )
        reasons: dict[str, str] = {}
        failures: dict[str, str] = {}
        self.in_flight.add(lease_id)
        try:
            for provider in self.policy.order(self.providers, spec):
                availability = await provider.available(spec)
                if not availability.ok:
                    reasons[provider.name] = availability.reason
                    continue
                try:
                    resource = await self.store.reserve(
                        new,
                        provider.name,
                        max_live=provider.max_workers,
                        resources=provider.exclusive_resources(spec),
                        now=self.now_us(),
                    )
                except AtCapacity as exc:
                    reasons[provider.name] = exc.message
                    continue
                record = await self._provision(provider, replace(spec, resource=resource), new)
                if isinstance(record, LeaseRecord):
                    return record
                failures[provider.name] = record
        finally:
            self.in_flight.discard(lease_id)
        return await self._no_lease(lease_id, request, reasons, failures)

    async def _provision(
        self, provider: Provider, spec: WorkerSpec, new: NewLease
    ) -> LeaseRecord | str:
        """The lease on `provider`, or why it failed (after cleaning up)."""
        attributes = _span_attributes(spec.lease_id, provider.name, spec.kind, spec.correlation_id)
        with self.tracer.start_as_current_span("provision", attributes=attributes) as span:
            started = time.perf_counter()
            try:
                worker = await asyncio.wait_for(
                    provider.provision(spec), timeout=self.provision_timeout
                )
            except (ProviderError, TimeoutError) as exc:
                message = (
                    exc.message if isinstance(exc, ProviderError)
                    else f"no worker after {self.provision_timeout:g} s"
                )
                span.set_status(Status(StatusCode.ERROR, message))
                log.warning("lease %s: %s failed to provision: %s",
                            spec.lease_id, provider.name, message)
                await self._clean_half_made(provider, spec.lease_id)
                return message
            self.metrics.provision_seconds.labels(provider.name).observe(
                time.perf_counter() - started
            )
        # The TTL counts from the request: the worker was told LEASE_EXPIRES_AT before it
        # started, and lease and worker must agree on it.
        record = await self.store.activate(
            spec.lease_id,
            endpoint=worker.endpoint,
            provider_token=worker.provider_token,
            now=self.now_us(),
        )
        if record is None:
            # Reconciliation resolved the lease while we provisioned: do not leak.
            await self._clean_half_made(provider, spec.lease_id, worker.provider_token)
            return "the lease was resolved by reconciliation while provisioning"
        self.metrics.acquired.labels(provider.name, spec.kind.value, spec.gpu.value).inc()
        self.on_due(record.expires_at)
        log.info("lease %s acquired on %s (%s, gpu=%s, correlation_id=%s)", record.lease_id,
                 provider.name, record.kind, record.gpu, record.correlation_id)
        return record

    async def _clean_half_made(self, provider: Provider, lease_id: str, token: str = "") -> None:
        try:
            await provider.release(token, lease_id)
        except ProviderError as exc:
            # The reconciler destroys it later as an orphan: it carries our labels.
            log.warning("lease %s: could not clean up on %s yet: %s",
                        lease_id, provider.name, exc.message)

    async def _no_lease(
        self, lease_id: str, request: LeaseRequest, reasons: dict[str, str],
        failures: dict[str, str],
    ) -> LeaseRecord:
        what = f"kind={request.kind.value} gpu={request.gpu.value}"
        if request.region:
            what += f" region={request.region}"
        if failures:
            await self.store.fail(lease_id, error="; ".join(failures.values()), now=self.now_us())
            self.metrics.acquire_failures.labels("provision_failed").inc()
            raise ProvisionFailed(
                f"every candidate provider failed to provision {what}: "
                + "; ".join(f"{name}: {why}" for name, why in failures.items()),
                failures=failures,
                reasons=reasons,
            )
        self.metrics.acquire_failures.labels("no_provider").inc()
        raise NoProviderAvailable(
            f"no provider can serve {what}: "
            + "; ".join(f"{name}: {why}" for name, why in reasons.items()),
            reasons=reasons,
        )

    # --- release ---------------------------------------------------------------------

    async def release(self, lease_id: str, owner: str | None) -> None:
        record = await self.get(lease_id)
        if record.state in (LeaseState.released, LeaseState.failed):
            raise LeaseNotFound(f"lease {lease_id} is already released")
        _check_owner(record, owner)
        if record.state == LeaseState.provisioning:
            raise LeaseConflict(f"lease {lease_id} is still provisioning; release it once acquired")
        claimed = await self.store.claim_release(
            lease_id, ReleaseReason.explicit, now=self.now_us()
        )
        if claimed is None:
            raise LeaseNotFound(f"lease {lease_id} is already released")
        error = await self.destroy(claimed)
        if error is not None:
            raise ReleaseFailed(
                f"{claimed.provider} could not destroy the worker of lease {lease_id}: {error}; "
                "the lease stays releasing and the scheduler keeps retrying",
                lease_id=lease_id,
                provider=claimed.provider,
            )

    async def destroy(self, record: LeaseRecord) -> str | None:
        """Destroy a claimed `releasing` lease's worker and record the outcome. Returns
        None when done, or why the provider could not confirm (a retry is scheduled)."""
        attributes = _span_attributes(
            record.lease_id, record.provider, record.kind, record.correlation_id
        )
        with self.tracer.start_as_current_span("release", attributes=attributes) as span:
            provider = self.by_name.get(record.provider)
            try:
                if provider is None:
                    raise ProviderError(f"provider {record.provider!r} is not configured")
                await provider.release(record.provider_token, record.lease_id)
            except ProviderError as exc:
                span.set_status(Status(StatusCode.ERROR, exc.message))
                attempts = record.release_attempts + 1
                retry_at = self.now_us() + int(_backoff(attempts) * 1e6)
                await self.store.release_attempt_failed(
                    record.lease_id, error=exc.message, retry_at=retry_at, now=self.now_us()
                )
                self.metrics.release_failures.labels(record.provider).inc()
                self.on_due(retry_at)
                log.warning("lease %s: release attempt %d on %s failed: %s",
                            record.lease_id, attempts, record.provider, exc.message)
                return exc.message
        done = await self.store.finish_release(record.lease_id, now=self.now_us())
        if done is not None:
            reason = done.release_reason or ReleaseReason.explicit.value
            self.metrics.released.labels(record.provider, reason).inc()
            log.info("lease %s released (%s)", record.lease_id, reason)
        return None

    # --- reads -----------------------------------------------------------------------

    async def get(self, lease_id: str) -> LeaseRecord:
        record = await self.store.get(lease_id) if _is_uuid(lease_id) else None
        if record is None:
            raise LeaseNotFound(f"no lease {lease_id[:64]!r}")
        return record

    async def list_active(self) -> list[dict]:
        return await self.store.list_wire((LeaseState.active,))

    async def list_active_json(self) -> bytes:
        """`list_active()` already encoded as a JSON array (cheap for 10,000 leases)."""
        return await self.store.list_wire_json((LeaseState.active,))


def _check_owner(record: LeaseRecord, owner: str | None) -> None:
    if record.owner_id is not None and owner != record.owner_id:
        if owner is None:
            raise Forbidden(f"lease {record.lease_id} has an owner; send X-Lease-Owner")
        raise Forbidden(f"X-Lease-Owner does not match the owner of lease {record.lease_id}")


def _backoff(attempts: int) -> float:
    return float(min(RETRY_BACKOFF_CAP_S, 2 ** (attempts - 1)))


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return len(value) == 36


def _span_attributes(
    lease_id: str, provider: str, kind: str, correlation_id: str | None
) -> dict[str, str]:
    attributes = {"lease_id": lease_id, "provider": provider, "kind": str(kind)}
    if correlation_id:
        attributes["correlation_id"] = correlation_id
    return attributes
