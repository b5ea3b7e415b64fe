"""LeaseStore: every read and every state change of a lease.

Every state change is a guarded update (`... WHERE state IN <expected>`), so two actors
racing on one lease (a DELETE and the sweeper, two replicas) never both win. Providers
are never called from inside a transaction here: the service loads, acts outside, then
applies the outcome. Which database runs the transactions is the backend's business
(store/backend.py); nothing here asks."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import func, select, text, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from openalice_scheduler.errors import StoreUnavailable
from openalice_scheduler.models import LeaseState, ReleaseReason
from openalice_scheduler.store.backend import Backend
from openalice_scheduler.store.listing import ListingEncoder
from openalice_scheduler.store.records import (
    WIRE_COLUMNS,
    DuplicateRequest,
    LeaseRecord,
    Move,
    NewLease,
    StateSets,
    record_of,
    wire_of,
)
from openalice_scheduler.store.replicas import Replicas
from openalice_scheduler.store.reserving import Reserving
from openalice_scheduler.store.schema import leases, store_identity
from openalice_scheduler.store.spending import live_price, spent_since
from openalice_scheduler.store.statements import (
    GET,
    lease_statements,
    released,
    state_in,
    transition_tx,
)
from openalice_scheduler.store.waiters import Waiters
from openalice_scheduler.times import DAY_US

# A worker's release is being attempted by someone: nobody else retries it before then.
RELEASE_CLAIM_US = 60_000_000
T = TypeVar("T")
# Check of a lease in a release's transaction; raises to refuse (None: unknown lease).
Check = Callable[[LeaseRecord | None], None]


class LeaseStore:
    def __init__(
        self, backend: Backend, *, states: StateSets, replica_id: str | None = None
    ) -> None:
        self.backend = backend
        # The core's sets of states (lifecycle/states.py), and statements built for them.
        self.states = states
        self.statements = lease_statements(states)
        # This process among the replicas sharing the store: it marks the leases it
        # provisions, so another replica can tell a crashed provision from a slow one.
        self.replica_id = replica_id or uuid.uuid4().hex
        self.replicas = Replicas(backend, self.replica_id)
        # This replica's callers in line, as every replica sees them.
        self.waiters = Waiters(backend, self.replica_id)
        # The store's own id (schema.store_identity), known once migrated.
        self.store_id: str | None = None
        # Leases whose reserve or activation failed with the store unavailable (their
        # acquire answered 503): committed all the same when the connection was lost
        # during COMMIT. The service settles them once the store answers again.
        self.unsure: set[str] = set()
        self._listing = ListingEncoder()

    @property
    def path(self) -> Path | None:
        return self.backend.path

    async def migrate(self) -> None:
        """Bring the schema to the newest Alembic revision; then `store_id` is known."""
        await self.backend.schema(self._upgrade)
        self.store_id = await self.backend.read(
            lambda conn: conn.execute(select(store_identity.c.store_id)).scalar_one()
        )
        if self.backend.exclusive:
            # Nobody else uses this store: whoever waited in line before is gone.
            await self.waiters.forget_all()

    async def close(self) -> None:
        await self.backend.close()

    async def ping(self) -> None:
        await self.backend.read(lambda conn: conn.execute(text("SELECT 1")))

    # --- acquire ---------------------------------------------------------------------

    async def reserve(
        self, lease: NewLease, tx: Callable[[Reserving], T], *, replica_id: str | None = None
    ) -> T:
        """Run a reserving transaction of the core's (lifecycle/admission.py) for `lease`,
        its rows written as `replica_id`'s (the replica making the worker; this one by
        default). Raises what its checks raise, or DuplicateRequest when another live
        lease has the same owner_id and correlation_id (another replica won the race)."""
        mine, made = replica_id or self.replica_id, self.statements
        try:
            return await self.backend.write(
                lambda conn: tx(Reserving(conn, self.backend, mine, made))
            )
        except StoreUnavailable:
            self.unsure.add(lease.lease_id)
            raise
        except IntegrityError as exc:
            existing = await self.find_request(lease.owner_id, lease.correlation_id)
            if existing is None:
                raise
            raise DuplicateRequest(existing.lease_id) from exc

    async def activate(
        self,
        lease_id: str,
        move: Move,
        *,
        endpoint: str,
        provider_token: str,
        now: int,
        gpu_type: str | None = None,
        price_per_hour: float | None = None,
        worker_url: str | None = None,
    ) -> LeaseRecord | None:
        """The lease by `move` (to `active`), granted now: its cost counts from here.
        `gpu_type` and `price_per_hour`, when given, are what the provider says the
        worker is and costs (the price reserved with the lease stays otherwise). None
        when the lease is in no source state (a reconciler resolved it meanwhile): the
        caller must destroy its worker."""
        found: dict[str, Any] = {
            "gpu_type": gpu_type,
            "price_per_hour": price_per_hour,
            "worker_url": worker_url,
        }
        try:
            return await self._transition(
                lease_id,
                move,
                endpoint=endpoint,
                provider_token=provider_token,
                updated_at=now,
                granted_at=now,
                **{k: v for k, v in found.items() if v is not None},
            )
        except StoreUnavailable:
            self.unsure.add(lease_id)
            raise

    async def fail(self, lease_id: str, move: Move, *, error: str, now: int) -> LeaseRecord | None:
        """The lease by `move` (to `failed`); its worker, if any, is destroyed by the
        caller."""
        return await self._transition(
            lease_id,
            move,
            frees=True,
            release_reason=ReleaseReason.failed.value,
            released_at=now,
            last_error=error[:2000],
            updated_at=now,
        )

    async def claim_release(
        self,
        lease_id: str,
        reason: ReleaseReason,
        move: Move,
        *,
        now: int,
        check: Check | None = None,
        at_once: tuple[Move, Sequence[str]] | None = None,
    ) -> LeaseRecord | None:
        """The lease by `move` (to `releasing`), claimed for one attempt to destroy its
        worker. A lease on one of the providers of `at_once` (nothing to destroy) goes by
        its move instead (to `released`). In the same transaction, `check` first sees
        the lease as it is and may refuse by raising. None when the lease was in no
        source state."""

        def _tx(conn: Connection) -> LeaseRecord | None:
            row = conn.execute(GET, {"b_id": lease_id}).first()
            current = record_of(row) if row else None
            if check is not None:
                check(current)
            if at_once is not None and current is not None and current.provider in at_once[1]:
                return transition_tx(
                    conn,
                    lease_id,
                    at_once[0].sources,
                    released(at_once[0], now, reason),
                    self.backend,
                )
            return transition_tx(
                conn,
                lease_id,
                move.sources,
                {
                    "state": move.target.value,
                    "release_reason": reason.value,
                    "next_attempt_at": now + RELEASE_CLAIM_US,
                    "updated_at": now,
                },
            )

        return await self.backend.write(_tx)

    async def claim_expired(self, move: Move, *, now: int, limit: int = 100) -> list[LeaseRecord]:
        """Leases past `expires_at`, by `move` (to `releasing`, reason `expired`)."""
        return await self._claim_due(
            move, leases.c.expires_at, now, limit, release_reason=ReleaseReason.expired.value
        )

    async def claim_preempted(self, move: Move, *, now: int, limit: int = 100) -> list[LeaseRecord]:
        """Leases whose preemption's grace is over, by `move` (to `releasing`, reason
        `preempted`)."""
        return await self._claim_due(
            move, leases.c.preempt_at, now, limit, release_reason=ReleaseReason.preempted.value
        )

    async def claim_retries(self, move: Move, *, now: int, limit: int = 100) -> list[LeaseRecord]:
        """Leases whose next release attempt is due, by `move`, claimed for one attempt."""
        return await self._claim_due(move, leases.c.next_attempt_at, now, limit)

    async def _claim_due(
        self, move: Move, due: Any, now: int, limit: int, **values: Any
    ) -> list[LeaseRecord]:
        """Leases in a source state of `move` whose `due` column has come, each claimed
        for one release attempt by a guarded update (a racing claimer may win some)."""
        sources = state_in([s.value for s in move.sources])

        def _tx(conn: Connection) -> list[LeaseRecord]:
            ids = (
                conn.execute(
                    select(leases.c.lease_id).where(sources, due <= now).order_by(due).limit(limit)
                )
                .scalars()
                .all()
            )
            claimed = []
            for lease_id in ids:
                row = conn.execute(
                    update(leases)
                    .where(leases.c.lease_id == lease_id, sources, due <= now)
                    .values(
                        state=move.target.value,
                        updated_at=now,
                        next_attempt_at=now + RELEASE_CLAIM_US,
                        **values,
                    )
                    .returning(*leases.c)
                ).first()
                if row:
                    claimed.append(record_of(row))
            return claimed

        return await self.backend.write(_tx)

    async def recover_claims(self, *, now: int) -> int:
        """At start-up, in a store this process alone uses: the release claims it finds
        were made by a process that is gone, and must not delay those releases."""
        if not self.backend.exclusive:
            return 0

        def _tx(conn: Connection) -> int:
            return conn.execute(
                update(leases)
                .where(state_in(self.states.retrying), leases.c.next_attempt_at > now)
                .values(next_attempt_at=now)
            ).rowcount

        return await self.backend.write(_tx)

    async def finish_release(
        self, lease_id: str, move: Move, *, now: int, reason: ReleaseReason | None = None
    ) -> LeaseRecord | None:
        """The lease by `move` (to `released`), its worker destroyed."""
        return await self._transition(lease_id, move, frees=True, **released(move, now, reason))

    async def release_attempt_failed(
        self, lease_id: str, move: Move, *, error: str, retry_at: int, now: int
    ) -> LeaseRecord | None:
        """The lease by `move` (still `releasing`), one more attempt counted, the next
        due at `retry_at`."""

        def _tx(conn: Connection) -> LeaseRecord | None:
            row = conn.execute(
                update(leases)
                .where(leases.c.lease_id == lease_id, state_in([s.value for s in move.sources]))
                .values(
                    state=move.target.value,
                    release_attempts=leases.c.release_attempts + 1,
                    next_attempt_at=retry_at,
                    last_error=error[:2000],
                    updated_at=now,
                )
                .returning(*leases.c)
            ).first()
            return record_of(row) if row else None

        return await self.backend.write(_tx)

    async def mark_lost(
        self,
        lease_id: str,
        move: Move,
        *,
        now: int,
        reason: ReleaseReason = ReleaseReason.lost,
        cause: str | None = None,
        exit_code: int | None = None,
    ) -> LeaseRecord | None:
        """The lease by `move` (to `released`, reason `lost` by default): its worker
        stopped or vanished; `cause` and `exit_code` say why, when known."""
        ended = released(move, now, reason)
        return await self._transition(
            lease_id, move, frees=True, **ended, lost_cause=cause, exit_code=exit_code
        )

    async def renew(
        self, lease_id: str, move: Move, *, expires_at: int, now: int
    ) -> LeaseRecord | None:
        """Move an unexpired lease's expiry, by `move`. None when the lease is in no
        source state or already past its expiry: a lease is never resurrected."""

        def _tx(conn: Connection) -> LeaseRecord | None:
            row = conn.execute(
                update(leases)
                .where(
                    leases.c.lease_id == lease_id,
                    state_in([s.value for s in move.sources]),
                    leases.c.expires_at > now,
                )
                .values(state=move.target.value, expires_at=expires_at, updated_at=now)
                .returning(*leases.c)
            ).first()
            return record_of(row) if row else None

        return await self.backend.write(_tx)

    # --- reads -----------------------------------------------------------------------

    async def get(self, lease_id: str) -> LeaseRecord | None:
        def _tx(conn: Connection) -> LeaseRecord | None:
            row = conn.execute(GET, {"b_id": lease_id}).first()
            return record_of(row) if row else None

        return await self.backend.read(_tx)

    async def find_request(
        self, owner_id: str | None, correlation_id: str | None
    ) -> LeaseRecord | None:
        """The live (provisioning or active) lease made for this request, if any."""
        if owner_id is None or correlation_id is None:
            return None

        def _tx(conn: Connection) -> LeaseRecord | None:
            row = conn.execute(
                self.statements.request, {"b_owner": owner_id, "b_corr": correlation_id}
            ).first()
            return record_of(row) if row else None

        return await self.backend.read(_tx)

    async def list_json(self, states: Sequence[LeaseState]) -> bytes:
        """The leases in `states` as one JSON array of `Lease`, oldest first."""
        return await self.backend.read(self._listing.list_json, [s.value for s in states])

    async def search(
        self,
        *,
        states: Sequence[LeaseState],
        owner_id: str | None = None,
        kind: str | None = None,
        provider: str | None = None,
        limit: int = 1000,
        newest_first: bool = False,
    ) -> list[dict[str, Any]]:
        """The `Lease` of each lease in `states` matching the filters, oldest first (by
        created_at, which the listing index covers), or newest first."""
        query = select(*WIRE_COLUMNS).where(leases.c.state.in_([s.value for s in states]))
        for column, wanted in (
            (leases.c.owner_id, owner_id),
            (leases.c.kind, kind),
            (leases.c.provider, provider),
        ):
            if wanted is not None:
                query = query.where(column == wanted)
        created = leases.c.created_at.desc() if newest_first else leases.c.created_at
        query = query.order_by(created).limit(limit)
        return await self.backend.read(lambda conn: [wire_of(row) for row in conn.execute(query)])

    async def live(self, provider: str | None = None) -> list[LeaseRecord]:
        def _tx(conn: Connection) -> list[LeaseRecord]:
            query = select(leases).where(
                leases.c.state.in_([s.value for s in self.states.holds_capacity])
            )
            if provider is not None:
                query = query.where(leases.c.provider == provider)
            return [record_of(row) for row in conn.execute(query)]

        return await self.backend.read(_tx)

    async def next_due(self) -> int | None:
        """The earliest moment the sweeper has work: an expiry or a release retry."""

        def _tx(conn: Connection) -> int | None:
            expiry = conn.execute(
                select(func.min(leases.c.expires_at)).where(state_in(self.states.expiring))
            ).scalar()
            retry = conn.execute(
                select(func.min(leases.c.next_attempt_at)).where(state_in(self.states.retrying))
            ).scalar()
            preempt = conn.execute(
                select(func.min(leases.c.preempt_at)).where(state_in(self.states.in_grace))
            ).scalar()
            due = [t for t in (expiry, retry, preempt) if t is not None]
            return min(due) if due else None

        return await self.backend.read(_tx)

    async def owner_money(self, owner: str, *, now: int) -> tuple[float, float]:
        """(USD per hour of what `owner` pays for now, USD it spent over the last 24 h)."""

        def _tx(conn: Connection) -> tuple[float, float]:
            price = live_price(conn, owner, priced=self.statements.owner_price)
            return price, spent_since(conn, owner, now - DAY_US, now)

        return await self.backend.read(_tx)

    async def live_price(self) -> dict[str, float]:
        """USD per hour of what is paid for now (StateSets.paid), by provider."""

        def _tx(conn: Connection) -> dict[str, float]:
            rows = conn.execute(
                select(leases.c.provider, func.sum(leases.c.price_per_hour))
                .where(state_in(self.states.paid))
                .group_by(leases.c.provider)
            )
            return {provider: float(total or 0.0) for provider, total in rows}

        return await self.backend.read(_tx)

    async def count_by_state(self) -> dict[str, int]:
        def _tx(conn: Connection) -> dict[str, int]:
            rows = conn.execute(select(leases.c.state, func.count()).group_by(leases.c.state))
            return {state: count for state, count in rows}

        return await self.backend.read(_tx)

    async def count_held(self) -> list[tuple[str, str, str, str | None, int]]:
        """(provider, kind, gpu, owner_id, n) of live leases: capacity in use, quotas."""
        columns = (leases.c.provider, leases.c.kind, leases.c.gpu, leases.c.owner_id)

        def _tx(conn: Connection) -> list[tuple[str, str, str, str | None, int]]:
            rows = conn.execute(
                select(*columns, func.count())
                .where(leases.c.state.in_([s.value for s in self.states.holds_capacity]))
                .group_by(*columns)
            )
            return [(p, k, g, o, n) for p, k, g, o, n in rows]

        return await self.backend.read(_tx)

    async def announce_capacity(self) -> None:
        """Tell every replica (their waiting callers) that capacity may be free; in a
        store this process alone uses, there is nobody else to tell."""
        if not self.backend.exclusive:
            await self.backend.write(self.backend.announce_freed)

    async def listen_capacity(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever another replica frees capacity, until cancelled."""
        await self.backend.listen_freed(callback)

    # --- internals -------------------------------------------------------------------

    async def _transition(
        self, lease_id: str, move: Move, *, frees: bool = False, **values: Any
    ) -> LeaseRecord | None:
        return await self.backend.write(
            transition_tx,
            lease_id,
            move.sources,
            {**values, "state": move.target.value},
            self.backend if frees else None,
        )

    def _upgrade(self, conn: Connection) -> None:
        # Replicas starting together on a fresh database must not migrate it twice.
        self.backend.lock(conn, "migrate")
        config = Config()
        config.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
        config.attributes["connection"] = conn
        command.upgrade(config, "head")
