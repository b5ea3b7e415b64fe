"""The warm pool's transactions (docs/concepts/pools.md#warm-pools). A pool worker is a row of
`leases` with no owner: `warming` while made and probed, `idle` once ready. So every cap and
exclusive device the lease path counts (StateSets.holds_capacity) counts pool workers too, and
reconciliation sees them by their lease id; quotas and idempotency (`held`, `answered`) do not.

Claiming an idle worker for a request is one guarded UPDATE (`idle → provisioning`, the
core's move): two acquires (two replicas) racing for one worker never both win it. Which
checks a pool worker's reservation or claim makes is the core's (lifecycle/admission.py);
making one is LeaseStore.reserve's."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, func, select
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from openalice_scheduler.models import LeaseState, ReleaseReason
from openalice_scheduler.store.leases import RELEASE_CLAIM_US, LeaseStore
from openalice_scheduler.store.records import (
    DuplicateRequest,
    LeaseRecord,
    Move,
    NewLease,
    record_of,
)
from openalice_scheduler.store.reserving import Reserving
from openalice_scheduler.store.schema import leases
from openalice_scheduler.store.statements import state_in, transition_tx


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
        self._statements = _pool_statements(store.states.pooled, store.states.idle)

    async def ready(
        self,
        lease_id: str,
        move: Move,
        *,
        endpoint: str,
        provider_token: str,
        probe_url: str | None,
        now: int,
        gpu_type: str | None = None,
        price_per_hour: float | None = None,
    ) -> LeaseRecord | None:
        """The pool worker by `move` (to `idle`), ready (with the GPU type and price its
        provider gave, when it gave them). None when reconciliation resolved it."""
        values: dict[str, Any] = {
            "state": move.target.value,
            "endpoint": endpoint,
            "provider_token": provider_token,
            "probe_url": probe_url,
            "updated_at": now,
            "gpu_type": gpu_type,
            "pool_ready_at": now,
        }
        if price_per_hour is not None:
            values["price_per_hour"] = price_per_hour
        return await self.backend.write(transition_tx, lease_id, move.sources, values)

    async def claim(
        self, lease: NewLease, tx: Callable[[Reserving], LeaseRecord | None]
    ) -> LeaseRecord | None:
        """Run a claiming transaction of the core's (lifecycle/admission.py: the owner's
        checks, then `Reserving.claim` of the oldest idle worker) for the request `lease`
        describes. None when no idle worker was left. DuplicateRequest when another
        replica won the race for its (owner_id, correlation_id)."""
        try:
            return await self.backend.write(
                lambda conn: tx(
                    Reserving(conn, self.backend, self.store.replica_id, self.store.statements)
                )
            )
        except IntegrityError as exc:
            existing = await self.store.find_request(lease.owner_id, lease.correlation_id)
            if existing is None:
                raise
            raise DuplicateRequest(existing.lease_id) from exc

    async def recycle(self, lease_id: str, move: Move, *, now: int) -> LeaseRecord | None:
        """The idle worker by `move` (to `releasing`, reason `recycled`), claimed for one
        destroy attempt."""
        return await self.backend.write(
            transition_tx,
            lease_id,
            move.sources,
            {
                "state": move.target.value,
                "release_reason": ReleaseReason.recycled.value,
                "next_attempt_at": now + RELEASE_CLAIM_US,
                "updated_at": now,
            },
        )

    async def idle(self) -> list[LeaseRecord]:
        """Every idle pool worker, oldest first."""

        def _tx(conn: Connection) -> list[LeaseRecord]:
            return [record_of(row) for row in conn.execute(self._statements.all_idle)]

        return await self.backend.read(_tx)

    async def room_on(self, provider: str, gpu: str) -> list[str]:
        """Idle workers of `provider` whose destruction makes room, those of GPU class
        `gpu` first (they hold the exclusive device such a lease needs), oldest first."""

        def _tx(conn: Connection) -> list[str]:
            rows = conn.execute(self._statements.idle_on, {"b_provider": provider}).all()
            return [lease_id for lease_id, got in sorted(rows, key=lambda r: r[1] != gpu)]

        return await self.backend.read(_tx)

    async def acquires(self, since: int) -> list[Acquire]:
        """Every request that became a lease at or after `since` (µs), whatever became of
        it since: warm, cold, failed or ended."""

        def _tx(conn: Connection) -> list[Acquire]:
            rows = conn.execute(self._statements.acquires, {"b_since": since})
            return [Acquire(k, g, c, at, bool(pooled)) for k, g, c, at, pooled in rows]

        return await self.backend.read(_tx)

    async def starts(self, kind: str, gpu: str, since: int, most: int) -> list[int]:
        """µs from reserved to ready of the newest `most` pool workers of `kind` and `gpu`
        begun at or after `since` that became ready."""

        def _tx(conn: Connection) -> list[int]:
            values = {"b_kind": kind, "b_gpu": gpu, "b_since": since, "b_most": most}
            return [int(took) for (took,) in conn.execute(self._statements.starts, values)]

        return await self.backend.read(_tx)

    async def counts(self) -> list[PoolCount]:
        """Pool workers (warming, idle) per provider, kind, GPU class and state."""

        def _tx(conn: Connection) -> list[PoolCount]:
            return [PoolCount(*row) for row in conn.execute(self._statements.counts)]

        return await self.backend.read(_tx)


@dataclass(frozen=True, slots=True)
class Acquire:
    """A lease's request as a pool's demand: its kind, GPU class, caller's class and when
    it was asked for (µs)."""

    kind: str
    gpu: str
    priority_class: str
    requested_at: int
    # Served by a warm pool's worker.
    pooled: bool


@dataclass(frozen=True, slots=True)
class _PoolStatements:
    all_idle: Any
    idle_on: Any
    counts: Any
    acquires: Any
    starts: Any


@functools.cache
def _pool_statements(
    pooled: tuple[LeaseState, ...], idle: tuple[LeaseState, ...]
) -> _PoolStatements:
    """The pool's statements for the core's sets of states (StateSets.pooled, .idle),
    built once, the states written into the SQL as in statements.py."""
    is_idle = state_in(idle)
    return _PoolStatements(
        all_idle=select(leases).where(is_idle).order_by(leases.c.updated_at),
        idle_on=select(leases.c.lease_id, leases.c.gpu)
        .where(is_idle, leases.c.provider == bindparam("b_provider"))
        .order_by(leases.c.updated_at),
        counts=select(leases.c.provider, leases.c.kind, leases.c.gpu, leases.c.state, func.count())
        .where(state_in(pooled))
        .group_by(leases.c.provider, leases.c.kind, leases.c.gpu, leases.c.state),
        acquires=select(
            leases.c.kind,
            leases.c.gpu,
            leases.c.priority_class,
            leases.c.requested_at,
            leases.c.pooled_at.is_not(None),
        )
        .where(leases.c.requested_at >= bindparam("b_since"))
        .order_by(leases.c.requested_at),
        starts=select(leases.c.pool_ready_at - leases.c.pooled_at)
        .where(
            leases.c.pooled_at >= bindparam("b_since"),
            leases.c.pool_ready_at.is_not(None),
            leases.c.kind == bindparam("b_kind"),
            leases.c.gpu == bindparam("b_gpu"),
        )
        .order_by(leases.c.pooled_at.desc())
        .limit(bindparam("b_most")),
    )
