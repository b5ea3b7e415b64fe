"""What a reserving transaction reads and writes (a cold lease, a static one, a pool
worker being made, an idle one claimed): the facts its admission weighs and the row it
then writes. Which checks it makes, and in what order, is the core's
(lifecycle/admission.py); the store runs the whole in one write transaction
(LeaseStore.reserve) and holds no rule of its own."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, update
from sqlalchemy.engine import Connection

from openalice_scheduler.models import LeaseState
from openalice_scheduler.store.backend import Backend
from openalice_scheduler.store.records import LeaseRecord, Move, NewLease, record_of
from openalice_scheduler.store.schema import leases
from openalice_scheduler.store.spending import live_price, spent_since
from openalice_scheduler.store.statements import (
    INSERT,
    LeaseStatements,
    state_in,
    transition_tx,
)
from openalice_scheduler.store.waiters import decide, someone_waits


@dataclass(frozen=True, slots=True)
class Grant:
    """Where an admitted lease goes: the resource it holds (a GPU device, a static
    endpoint), on which host, at what price (USD per hour; None: unknown)."""

    resource: str | None = None
    host: str | None = None
    price: float | None = None


class Reserving:
    """One reserving transaction's reads and writes, on `conn`."""

    def __init__(
        self, conn: Connection, backend: Backend, replica_id: str, statements: LeaseStatements
    ) -> None:
        self.conn = conn
        self.backend = backend
        self.replica_id = replica_id
        # Built for the core's sets of states (LeaseStore.statements).
        self.statements = statements

    def lock(self, key: str) -> None:
        """Serialise, until this transaction ends, with every replica's that takes `key`."""
        self.backend.lock(self.conn, key)

    # --- facts -----------------------------------------------------------------------

    def twin(self, lease: NewLease) -> str | None:
        """Another live lease made for the same (owner_id, correlation_id)."""
        if not (lease.owner_id and lease.correlation_id):
            return None
        mine = {"b_id": lease.lease_id, "b_owner": lease.owner_id, "b_corr": lease.correlation_id}
        twin: str | None = self.conn.execute(self.statements.twin, mine).scalar()
        return twin

    def held(self, lease: NewLease) -> int:
        """The live leases of the lease's owner, this one left out."""
        mine = {"b_id": lease.lease_id, "b_owner": lease.owner_id}
        return int(self.conn.execute(self.statements.held_by_owner, mine).scalar_one())

    def live_on(self, lease: NewLease, provider: str) -> int:
        """The live workers of `provider` (pool workers too), this lease left out."""
        mine = {"b_id": lease.lease_id, "b_provider": provider}
        return int(self.conn.execute(self.statements.count_live, mine).scalar_one())

    def taken_on(self, lease: NewLease, provider: str) -> set[str]:
        """The resources the other live leases of `provider` hold."""
        mine = {"b_id": lease.lease_id, "b_provider": provider}
        return set(self.conn.execute(self.statements.taken, mine).scalars())

    def owner_price(self, lease: NewLease) -> float:
        """USD per hour of what the lease's owner pays for now, this lease left out."""
        assert lease.owner_id is not None
        return live_price(
            self.conn, lease.owner_id, lease.lease_id, priced=self.statements.owner_price
        )

    def owner_spent(self, lease: NewLease, since: int, now: int) -> float:
        """USD the owner's leases cost from `since` until `now`."""
        assert lease.owner_id is not None
        return spent_since(self.conn, lease.owner_id, since, now)

    def someone_waits(self, *, alive_since: int, now: int) -> bool:
        """Whether any caller waits in line (on a replica alive since `alive_since`)."""
        return someone_waits(self.conn, self.replica_id, alive_since=alive_since, now=now)

    def decide(self, waiter_id: str, granted: str | None, refusal: str | None, now: int) -> bool:
        """The admission loop's decision on an undecided caller still in line; False
        when it left meanwhile (the transaction is then undone by its caller)."""
        return decide(self.conn, waiter_id, granted, refusal, now)

    def preempt(
        self, victim: str, move: Move, *, preempt_at: int, by: str, now: int
    ) -> LeaseRecord | None:
        """The lease `victim` by `move` (to `preempting`): its worker goes at
        `preempt_at`, for the caller `by` names. None when it is no longer active."""
        return transition_tx(
            self.conn,
            victim,
            move.sources,
            {
                "state": move.target.value,
                "preempt_at": preempt_at,
                "preempted_by": by,
                "updated_at": now,
            },
        )

    def pooled(self, kind: str, gpu: str) -> int:
        """Pool workers (warming or idle) of `kind` and `gpu`."""
        return int(
            self.conn.execute(
                self.statements.count_pool, {"b_kind": kind, "b_gpu": gpu}
            ).scalar_one()
        )

    def oldest_idle(self, kind: str, gpu: str) -> tuple[str, str, float | None] | None:
        """The idle pool worker of `kind` and `gpu` idle longest (lease id, provider,
        price),
        locked: concurrent claims on PostgreSQL each lock a different one (SKIP LOCKED)
        instead of queueing on one (SQLite has one writer and no such clause)."""
        row = self.conn.execute(self.statements.oldest_idle, {"b_kind": kind, "b_gpu": gpu}).first()
        return None if row is None else (row[0], row[1], row[2])

    # --- writes ----------------------------------------------------------------------

    def write(
        self,
        lease: NewLease,
        provider: str,
        move: Move,
        grant: Grant,
        now: int,
        worker: tuple[str, str] | None = None,
    ) -> LeaseRecord:
        """The lease's row by `move`: inserted (a move from no state), or moved (from a
        provider that failed to provision it: its fence stays). `worker`: the endpoint
        and provider token of a worker that already runs (then granted now)."""
        values: dict[str, Any] = {
            "provider": provider,
            "state": move.target.value,
            "resource": grant.resource,
            "host": grant.host,
            "updated_at": now,
            "replica_id": self.replica_id,
            "endpoint": "",
            "provider_token": "",
            "price_per_hour": grant.price,
            "gpu_type": None,
            "granted_at": None,
        }
        if worker is not None:
            values["endpoint"], values["provider_token"] = worker
            values["granted_at"] = now
        if move.sources:
            moved = transition_tx(self.conn, lease.lease_id, move.sources, values)
            if moved is not None:
                return moved
        row = self.conn.execute(
            INSERT,
            {
                "lease_id": lease.lease_id,
                "kind": lease.kind,
                "gpu": lease.gpu,
                "owner_id": lease.owner_id,
                "correlation_id": lease.correlation_id,
                "region": lease.region,
                "ttl_seconds": lease.ttl_seconds,
                "created_at": lease.created_at,
                "expires_at": lease.expires_at,
                "release_attempts": 0,
                "priority_class": lease.priority_class,
                "requested_at": lease.requested_at,
                "pooled_at": lease.pooled_at,
                "fence": self.backend.next_fence(self.conn),
                **values,
            },
        ).one()
        return record_of(row)

    def claim(self, worker_id: str, lease: NewLease, move: Move) -> LeaseRecord | None:
        """The pool worker `worker_id`'s row, by `move`, for the request `lease` describes:
        its owner, correlation id, TTL and times; the row keeps its own lease id, which
        its worker already has. None when it is no longer in a source state."""
        row = self.conn.execute(
            _claim(move.sources, move.target),
            {
                "b_id": worker_id,
                "v_priority_class": lease.priority_class,
                "v_owner_id": lease.owner_id,
                "v_correlation_id": lease.correlation_id,
                "v_ttl_seconds": lease.ttl_seconds,
                "v_created_at": lease.created_at,
                "v_expires_at": lease.expires_at,
                "v_updated_at": lease.created_at,
                "v_replica_id": self.replica_id,
                "v_requested_at": lease.requested_at,
                # A fence larger than any before: what the worker served until now (its
                # idle fence, an earlier lease) is older than the lease it now serves.
                "v_fence": self.backend.next_fence(self.conn),
            },
        ).first()
        return record_of(row) if row is not None else None


_CLAIMED = (
    "priority_class",
    "owner_id",
    "correlation_id",
    "ttl_seconds",
    "created_at",
    "expires_at",
    "updated_at",
    "replica_id",
    "requested_at",
    "fence",
)


@functools.cache
def _claim(sources: tuple[LeaseState, ...], target: LeaseState) -> Any:
    return (
        update(leases)
        .where(leases.c.lease_id == bindparam("b_id"), state_in([s.value for s in sources]))
        .values(state=target.value, **{name: bindparam(f"v_{name}") for name in _CLAIMED})
        .returning(*leases.c)
    )
