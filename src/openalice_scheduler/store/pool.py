"""The warm pool's transactions (README, Warm pools). A pool worker is a row of `leases`
with no owner: `warming` while made and probed, `idle` once ready. So every cap and
exclusive device the lease path counts (`_COUNT_LIVE`, `_TAKEN`) counts pool workers too,
and reconciliation sees them by their lease id; quotas and idempotency (`_HELD`) do not.

Claiming an idle worker for a request is one guarded UPDATE `idle → provisioning`: two
acquires (two replicas) racing for one worker never both win it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from openalice_scheduler.models import LeaseState, ReleaseReason
from openalice_scheduler.store.leases import RELEASE_CLAIM_US, LeaseStore
from openalice_scheduler.store.records import (
    Budget,
    DuplicateRequest,
    LeaseRecord,
    NewLease,
    Terms,
    record_of,
)
from openalice_scheduler.store.reserving import owner_checks, reserve_tx
from openalice_scheduler.store.schema import leases
from openalice_scheduler.store.spending import check_budget
from openalice_scheduler.store.statements import state_in, transition_tx

_POOLED = (LeaseState.warming.value, LeaseState.idle.value)


@dataclass(frozen=True, slots=True)
class PoolCount:
    """Pool workers of one provider, kind and GPU class, in one state."""

    provider: str
    kind: str
    gpu: str
    state: str
    count: int


class PoolStore:
    """The pool's rows, over the lease store's backend and statements."""

    def __init__(self, store: LeaseStore) -> None:
        self.store = store
        self.backend = store.backend

    async def reserve(
        self, lease: NewLease, provider: str, terms: Terms, target: int
    ) -> LeaseRecord | None:
        """Record `lease` (no owner) as `warming` on `provider`, when its kind and GPU
        class have fewer than `target` pool workers (warming or idle), checked under a
        lock of that pool: exact across replicas. None when the pool is full. The
        provider's terms hold as for any lease (AtCapacity)."""

        def _tx(conn: Connection) -> LeaseRecord | None:
            self.backend.lock(conn, f"pool:{lease.kind}/{lease.gpu}")
            have = conn.execute(
                _COUNT_POOL, {"b_kind": lease.kind, "b_gpu": lease.gpu}
            ).scalar_one()
            if have >= target:
                return None
            return reserve_tx(
                conn,
                self.backend,
                self.store.replica_id,
                lease,
                provider,
                terms,
                None,
                False,
                LeaseState.warming,
            )

        return await self.backend.write(_tx)

    async def ready(
        self,
        lease_id: str,
        *,
        endpoint: str,
        provider_token: str,
        probe_url: str | None,
        now: int,
        gpu_type: str | None = None,
        price_per_hour: float | None = None,
    ) -> LeaseRecord | None:
        """warming → idle, its worker ready (with the GPU type and price its provider
        gave, when it gave them). None when reconciliation resolved it."""
        values: dict[str, Any] = {
            "state": LeaseState.idle.value,
            "endpoint": endpoint,
            "provider_token": provider_token,
            "probe_url": probe_url,
            "updated_at": now,
            "gpu_type": gpu_type,
        }
        if price_per_hour is not None:
            values["price_per_hour"] = price_per_hour
        return await self.backend.write(transition_tx, lease_id, (LeaseState.warming,), values)

    async def claim(
        self, lease: NewLease, quota: int, budget: Budget | None = None
    ) -> LeaseRecord | None:
        """The oldest idle worker of `lease.kind`/`lease.gpu`, claimed for the request
        `lease` describes (`idle → provisioning`, with its owner, correlation id, TTL and
        times; the row keeps its own lease id, which its worker already has). Under the
        owner's lock with the checks of a cold reserve (DuplicateRequest, OverQuota,
        OverBudget at the worker's price). None when no idle worker is left."""

        def _tx(conn: Connection) -> LeaseRecord | None:
            owner_checks(conn, self.backend, lease, quota)
            # One row, locked, SKIP LOCKED: concurrent claims on PostgreSQL each lock a
            # different idle row instead of queueing on one (SQLite has one writer and
            # no such clause). The guarded update still refuses a row no longer idle.
            oldest = conn.execute(_OLDEST_IDLE, {"b_kind": lease.kind, "b_gpu": lease.gpu}).first()
            if oldest is None:
                return None
            lease_id, price = oldest
            if budget is not None:
                check_budget(conn, lease, price, budget, lease.created_at)
            row = conn.execute(
                _CLAIM,
                {
                    "b_id": lease_id,
                    "v_owner_id": lease.owner_id,
                    "v_correlation_id": lease.correlation_id,
                    "v_ttl_seconds": lease.ttl_seconds,
                    "v_created_at": lease.created_at,
                    "v_expires_at": lease.expires_at,
                    "v_updated_at": lease.created_at,
                    "v_replica_id": self.store.replica_id,
                    # A fence larger than any before: what the worker served until now (its
                    # idle fence, an earlier lease) is older than the lease it now serves.
                    "v_fence": self.backend.next_fence(conn),
                },
            ).first()
            return record_of(row) if row is not None else None

        try:
            return await self.backend.write(_tx)
        except IntegrityError as exc:
            existing = await self.store.find_request(lease.owner_id, lease.correlation_id)
            if existing is None:
                raise
            raise DuplicateRequest(existing.lease_id) from exc

    async def recycle(self, lease_id: str, *, now: int) -> LeaseRecord | None:
        """idle → releasing (reason `recycled`), claimed for one destroy attempt."""
        return await self.backend.write(
            transition_tx,
            lease_id,
            (LeaseState.idle,),
            {
                "state": LeaseState.releasing.value,
                "release_reason": ReleaseReason.recycled.value,
                "next_attempt_at": now + RELEASE_CLAIM_US,
                "updated_at": now,
            },
        )

    async def idle(self) -> list[LeaseRecord]:
        """Every idle pool worker, oldest first."""

        def _tx(conn: Connection) -> list[LeaseRecord]:
            return [record_of(row) for row in conn.execute(_ALL_IDLE)]

        return await self.backend.read(_tx)

    async def room_on(self, provider: str, gpu: str) -> list[str]:
        """Idle workers of `provider` whose destruction makes room, those of GPU class
        `gpu` first (they hold the exclusive device such a lease needs), oldest first."""

        def _tx(conn: Connection) -> list[str]:
            rows = conn.execute(_IDLE_ON, {"b_provider": provider}).all()
            return [lease_id for lease_id, got in sorted(rows, key=lambda r: r[1] != gpu)]

        return await self.backend.read(_tx)

    async def counts(self) -> list[PoolCount]:
        """Pool workers (warming, idle) per provider, kind, GPU class and state."""

        def _tx(conn: Connection) -> list[PoolCount]:
            return [PoolCount(*row) for row in conn.execute(_COUNTS)]

        return await self.backend.read(_tx)


# States written into the SQL, as in leases.py: statements built once bind only values.
_IN_POOL = state_in(_POOLED)
_THIS_POOL = (leases.c.kind == bindparam("b_kind"), leases.c.gpu == bindparam("b_gpu"))
_IS_IDLE = state_in((LeaseState.idle.value,))
_COUNT_POOL = select(func.count()).select_from(leases).where(_IN_POOL, *_THIS_POOL)
# A pool worker serves only requests without a region: it was made for none.
_OLDEST_IDLE = (
    select(leases.c.lease_id, leases.c.price_per_hour)
    .where(_IS_IDLE, *_THIS_POOL, leases.c.region.is_(None))
    .order_by(leases.c.updated_at)
    .limit(1)
    .with_for_update(skip_locked=True)
)
_CLAIM = (
    update(leases)
    .where(leases.c.lease_id == bindparam("b_id"), _IS_IDLE)
    .values(
        state=LeaseState.provisioning.value,
        **{
            name: bindparam(f"v_{name}")
            for name in (
                "owner_id",
                "correlation_id",
                "ttl_seconds",
                "created_at",
                "expires_at",
                "updated_at",
                "replica_id",
                "fence",
            )
        },
    )
    .returning(*leases.c)
)
_ALL_IDLE = select(leases).where(_IS_IDLE).order_by(leases.c.updated_at)
_IDLE_ON = (
    select(leases.c.lease_id, leases.c.gpu)
    .where(_IS_IDLE, leases.c.provider == bindparam("b_provider"))
    .order_by(leases.c.updated_at)
)
_COUNTS = (
    select(leases.c.provider, leases.c.kind, leases.c.gpu, leases.c.state, func.count())
    .where(_IN_POOL)
    .group_by(leases.c.provider, leases.c.kind, leases.c.gpu, leases.c.state)
)
