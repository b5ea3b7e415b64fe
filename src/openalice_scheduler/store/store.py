"""LeaseStore: the only code that touches the database.

Every state change is a guarded update (`... WHERE state = <expected>`), so two actors
racing on one lease (a DELETE and the sweeper, two replicas) never both win. Providers
are never called from inside a transaction here: the service loads, acts outside, then
applies the outcome."""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import String, bindparam, cast, func, literal_column, select, text, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from openalice_scheduler.models import LIVE_STATES, LeaseState, ReleaseReason
from openalice_scheduler.store.database import ROLLBACKS, Database, ping
from openalice_scheduler.store.schema import leases, locks, replicas, store_identity

log = logging.getLogger(__name__)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_NAIVE = datetime(1970, 1, 1)
# A worker's release is being attempted by someone: nobody else retries it before then.
RELEASE_CLAIM_US = 60_000_000
_DAY_US = 86_400_000_000
# PostgreSQL channel on which replicas announce freed capacity to each other's waiters.
CAPACITY_CHANNEL = "openalice_capacity"


def to_us(moment: datetime) -> int:
    delta = moment.astimezone(UTC) - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_us(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def format_us(us: int) -> str:
    """RFC 3339 in UTC with microseconds: `2026-11-29T17:34:49.948395Z`."""
    # isoformat on a naive datetime is ~3x faster than strftime, with the same text.
    return (_EPOCH_NAIVE + timedelta(microseconds=us)).isoformat(timespec="microseconds") + "Z"


# Not frozen (a record is never changed once made, all the same): a frozen dataclass sets
# each field through object.__setattr__, and made this one in 5.5 µs against 0.7, twice
# per lease round trip. The same for NewLease and _Reservation.
@dataclass(slots=True)
class LeaseRecord:
    lease_id: str
    provider: str
    kind: str
    gpu: str
    state: str
    endpoint: str
    provider_token: str
    owner_id: str | None
    correlation_id: str | None
    region: str | None
    resource: str | None
    ttl_seconds: int
    created_at: int
    expires_at: int
    released_at: int | None
    release_reason: str | None
    release_attempts: int
    next_attempt_at: int | None
    last_error: str | None
    updated_at: int
    replica_id: str | None = None

    def wire(self) -> dict[str, Any]:
        """The `Lease` wire shape, built directly: listing 10,000 leases stays cheap."""
        return {
            "lease_id": self.lease_id,
            "provider": self.provider,
            "kind": self.kind,
            "endpoint": self.endpoint,
            "created_at": format_us(self.created_at),
            "expires_at": format_us(self.expires_at),
            "provider_token": self.provider_token,
            "owner_id": self.owner_id,
            "gpu": self.gpu,
            "correlation_id": self.correlation_id,
            "region": self.region,
            "state": self.state,
            "release_reason": self.release_reason,
            "released_at": None if self.released_at is None else format_us(self.released_at),
        }


@dataclass(slots=True)
class NewLease:
    lease_id: str
    kind: str
    gpu: str
    owner_id: str | None
    correlation_id: str | None
    region: str | None
    ttl_seconds: int
    created_at: int
    expires_at: int


class AtCapacity(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class OverQuota(AtCapacity):
    """The owner already holds MAX_LEASES_PER_OWNER live leases."""


class DuplicateRequest(Exception):
    """A live lease already answers this (owner_id, correlation_id)."""

    def __init__(self, lease_id: str) -> None:
        super().__init__(lease_id)
        self.lease_id = lease_id


_COLUMNS = [c.name for c in leases.columns]
_LIVE = [s.value for s in LIVE_STATES]
# What counts against an owner's quota: leases being made or in use.
_HELD = [LeaseState.provisioning.value, LeaseState.active.value]


class _Prepared:
    """A statement of the lease path, built once and compiled once per dialect.

    On SQLite it runs straight on the driver's connection (inside the SQLAlchemy
    transaction of the caller): ~15 µs for a simple update, against ~150 µs through
    SQLAlchemy's execution path even with its compiled cache, and ~570 µs for a
    statement built per call. On PostgreSQL it runs through SQLAlchemy, which reuses
    its compiled form. Rows come back as plain tuples."""

    __slots__ = ("statement", "_sqlite")

    def __init__(self, statement: Any) -> None:
        self.statement = statement
        self._sqlite: tuple[str, tuple[str, ...], dict[str, Any]] | None = None

    def _cursor(self, conn: Connection, params: dict[str, Any]) -> Any:
        if conn.dialect.name != "sqlite":
            return None
        if self._sqlite is None:
            compiled = self.statement.compile(dialect=conn.dialect)
            self._sqlite = (compiled.string, tuple(compiled.positiontup or ()),
                            dict(compiled.params))
        sql, names, defaults = self._sqlite
        driver = conn.connection.driver_connection
        return driver.execute(sql, [params.get(n, defaults[n]) for n in names])  # type: ignore[union-attr]

    def first(self, conn: Connection, params: dict[str, Any]) -> Any:
        cursor = self._cursor(conn, params)
        if cursor is None:
            return conn.execute(self.statement, params).first()
        rows = cursor.fetchall()
        return rows[0] if rows else None

    def scalar(self, conn: Connection, params: dict[str, Any]) -> Any:
        row = self.first(conn, params)
        return None if row is None else row[0]

    def scalars(self, conn: Connection, params: dict[str, Any]) -> list[Any]:
        cursor = self._cursor(conn, params)
        if cursor is None:
            return list(conn.execute(self.statement, params).scalars())
        return [row[0] for row in cursor.fetchall()]

    def rowcount(self, conn: Connection, params: dict[str, Any]) -> int:
        cursor = self._cursor(conn, params)
        if cursor is None:
            return int(conn.execute(self.statement, params).rowcount)
        return int(cursor.rowcount)


# The statements of the lease path, built once (see _Prepared).
_BY_ID = leases.c.lease_id == bindparam("b_lease_id")
_OTHER = leases.c.lease_id != bindparam("b_lease_id")


def _state_in(states: Sequence[str]) -> Any:
    """`state IN ('a', 'b')` with the constants written into the SQL: no parameters to
    expand on every execution."""
    return leases.c.state.in_([literal_column(f"'{LeaseState(s).value}'") for s in states])


_SAME_REQUEST = (
    leases.c.owner_id == bindparam("owner_id"),
    leases.c.correlation_id == bindparam("correlation_id"),
    _state_in(_HELD),
)
_LIVE_ON = (leases.c.provider == bindparam("provider"), _state_in(_LIVE), _OTHER)
_GET = _Prepared(select(leases).where(_BY_ID))
_FIND_REQUEST = _Prepared(select(leases).where(*_SAME_REQUEST))
_TWIN = _Prepared(select(leases.c.lease_id).where(*_SAME_REQUEST, _OTHER))
_HELD_BY_OWNER = _Prepared(select(func.count()).select_from(leases).where(
    leases.c.owner_id == bindparam("owner_id"), _state_in(_HELD), _OTHER
))
_COUNT_LIVE = _Prepared(select(func.count()).select_from(leases).where(*_LIVE_ON))
_TAKEN = _Prepared(
    select(leases.c.resource).where(*_LIVE_ON, leases.c.resource.is_not(None))
)
# The same for a lease not yet written (a first try): no `lease_id != ?` to check.
_TAKEN_NEW = _Prepared(
    select(leases.c.resource).where(*_LIVE_ON[:2], leases.c.resource.is_not(None))
)


class _TakenCache:
    """SQLite: per provider, the resources its live leases hold, as _TAKEN_NEW returns
    them, without running it for every reservation (~40 µs of the ~0.65 ms a static
    round trip costs the event loop).

    Exact, not a guess: kept only while every change to the file since it was read is
    one this cache applied itself. The lease path's two writes (a reservation taking a
    resource, release_at_once freeing one) apply theirs when their statement changed
    exactly one row. Anything else starts it over: a write of any other kind by the
    writer connection (its `total_changes` moves on), a commit by another connection
    (`PRAGMA data_version`), a rolled-back transaction (the writer counts them in its
    connection's `info`, see database._Sqlite), or another connection."""

    __slots__ = ("_sets", "_mark")

    def __init__(self) -> None:
        self._sets: dict[str, set[str]] = {}
        self._mark: tuple[int, int, int, int] | None = None

    def taken(self, conn: Connection, params: dict[str, Any]) -> set[str]:
        raw = conn.connection.driver_connection
        assert raw is not None
        mark = (raw.total_changes, raw.execute("PRAGMA data_version").fetchone()[0],
                conn.info.get(ROLLBACKS, 0), id(raw))
        if mark != self._mark:
            self._sets.clear()
            self._mark = mark
        found = self._sets.get(params["provider"])
        if found is None:
            found = self._sets[params["provider"]] = set(_TAKEN_NEW.scalars(conn, params))
        return found

    def wrote(self, conn: Connection, provider: str, *, took: str | None = None,
              freed: str | None = None) -> None:
        """After a statement of the lease path that changed one row: `took` is now held,
        `freed` no longer."""
        raw = conn.connection.driver_connection
        assert raw is not None
        mark = self._mark
        if mark is None or raw.total_changes != mark[0] + 1 or id(raw) != mark[3]:
            self._mark = None
            return
        self._mark = (mark[0] + 1, *mark[1:])
        found = self._sets.get(provider)
        if found is not None:
            if took is not None:
                found.add(took)
            found.discard(freed)  # type: ignore[arg-type]  # None: freed none


_RESERVED = {"provider", "state", "resource", "updated_at", "replica_id"}
_MOVE = _Prepared(
    update(leases)
    .where(_BY_ID, leases.c.state == LeaseState.provisioning.value)
    .values({name: bindparam(f"v_{name}") for name in sorted(_RESERVED)})
)
# Every column is given, so one compiled form serves every insert, and the new row is
# known without reading it back: RETURNING would double what an insert costs SQLite
# (~48 µs against ~22, bench/README.md).
_INSERT = _Prepared(leases.insert().values(
    {name: bindparam(f"v_{name}") for name in _COLUMNS}
))
_INSERTED = tuple(f"v_{name}" for name in _COLUMNS)
# Guarded updates by (expected states, columns set): see _transition_tx.
_TRANSITIONS: dict[tuple[tuple[str, ...], tuple[str, ...]], _Prepared] = {}


def _transition_statement(expected: tuple[str, ...], columns: tuple[str, ...]) -> _Prepared:
    statement = _TRANSITIONS.get((expected, columns))
    if statement is None:
        statement = _TRANSITIONS[expected, columns] = _Prepared(
            update(leases)
            .where(_BY_ID, _state_in(expected))
            .values({name: bindparam(f"v_{name}") for name in columns})
            .returning(*leases.c)
        )
    return statement


def _transition_tx(
    conn: Connection, lease_id: str, expected: Sequence[LeaseState], frees: bool,
    values: dict[str, Any],
) -> LeaseRecord | None:
    """Guarded update of one lease. `frees`: the lease stops holding capacity, which
    other replicas hear about (PostgreSQL NOTIFY, sent on commit)."""
    columns = tuple(sorted(values))
    statement = _transition_statement(tuple(s.value for s in expected), columns)
    params = {f"v_{name}": values[name] for name in columns}
    params["b_lease_id"] = lease_id
    row = statement.first(conn, params)
    if row and frees and conn.dialect.name == "postgresql":
        conn.execute(text(f"NOTIFY {CAPACITY_CHANNEL}"))
    return _record(row) if row else None


# By number of providers: without and with RETURNING, and for a lease as it was written
# (LeaseStore.release_at_once).
_RELEASE_AT_ONCE: dict[int, tuple[_Prepared, _Prepared, _Prepared]] = {}
# Leases kept by LeaseStore._recent (~4 MB); past that, the oldest are read again.
_RECENT_MAX = 10_000
_RELEASED_COLUMNS = ("state", "released_at", "next_attempt_at", "updated_at", "release_reason")


def _released_values(now: int, reason: str | None = None) -> dict[str, Any]:
    values: dict[str, Any] = {
        "state": LeaseState.released.value,
        "released_at": now,
        "next_attempt_at": None,
        "updated_at": now,
    }
    if reason is not None:
        values["release_reason"] = reason
    return values


class LeaseStore:
    def __init__(
        self, database_url: str, *, replica_id: str | None = None,
        sqlite_synchronous: str = "full",
    ) -> None:
        self.db = Database(database_url, sqlite_synchronous=sqlite_synchronous)
        # This process, among the replicas sharing the store: it marks the leases it
        # provisions, so that another replica can tell a crashed provision from a slow one.
        self.replica_id = replica_id or uuid.uuid4().hex
        # The store's own id (see schema.store_identity), known once migrated.
        self.store_id: str | None = None
        self.dialect = self.db.dialect
        # lease_id -> ((state, updated_at, expires_at), encoded Lease): see list_wire_json.
        self._wire_cache: dict[str, tuple[tuple[Any, ...], bytes]] = {}
        # (states, key list it was built from, body) of the last listing, SQLite only.
        self._wire_body: tuple[tuple[str, ...], str, bytes] | None = None
        # SQLite: leases that reserve_active recorded, as written, oldest first; see
        # release_at_once. At most _RECENT_MAX.
        self._recent: dict[str, LeaseRecord] = {}
        self._taken = _TakenCache() if self.dialect == "sqlite" else None

    @property
    def sqlite_path(self) -> Path | None:
        return self.db.sqlite_path

    async def migrate(self) -> None:
        """Bring the schema to the newest Alembic revision; then `store_id` is known."""
        await self.db.write(_upgrade)
        self.store_id = await self.db.read(
            lambda conn: conn.execute(select(store_identity.c.store_id)).scalar_one()
        )

    async def close(self) -> None:
        await self.db.close()

    async def ping(self) -> None:
        await self.db.read(ping)

    # --- acquire ---------------------------------------------------------------------

    async def reserve(
        self,
        lease: NewLease,
        provider: str,
        *,
        max_live: int,
        resources: Sequence[str] | None,
        now: int,
        owner_quota: int = 0,
        resource_label: str = "GPU devices",
        first_try: bool = False,
    ) -> str | None:
        """Record `lease` as `provisioning` on `provider`, atomically checking the
        provider's cap on live workers and taking one free exclusive resource (a GPU)
        when `resources` is given. Returns the resource taken. Raises AtCapacity.

        Called again for the same lease after a failed provider, it moves the lease
        (and its reservation) to the next provider.

        Raises DuplicateRequest when another live lease has the same owner_id and
        correlation_id, OverQuota when the owner holds `owner_quota` live leases.
        `first_try`: no earlier reserve of this lease succeeded (saves a lookup)."""
        reservation = _Reservation(lease, provider, max_live, resources, now, owner_quota,
                                   resource_label, self.replica_id, first_try=first_try,
                                   taken=self._taken)
        return await self._reserve(reservation)

    async def reserve_active(
        self,
        lease: NewLease,
        provider: str,
        *,
        assign: Callable[[str | None], tuple[str, str]],
        max_live: int,
        resources: Sequence[str] | None,
        now: int,
        owner_quota: int = 0,
        resource_label: str = "GPU devices",
        first_try: bool = False,
    ) -> LeaseRecord:
        """`reserve`, for a provider whose workers already exist (static endpoints):
        `assign(resource)` names the worker's (endpoint, provider_token) without calling
        anything, so the lease is recorded `active` at once, in the same transaction.
        Returns the lease; raises as `reserve` does."""
        reservation = _Reservation(lease, provider, max_live, resources, now, owner_quota,
                                   resource_label, self.replica_id, assign, first_try,
                                   self._taken)
        record = await self._reserve(reservation)
        assert isinstance(record, LeaseRecord)
        if self.dialect == "sqlite":
            recent = self._recent
            recent[record.lease_id] = record
            if len(recent) > _RECENT_MAX:
                del recent[next(iter(recent))]
        return record

    async def _reserve(self, reservation: _Reservation) -> Any:
        try:
            return await self.db.write(reservation.run)
        except IntegrityError as exc:
            # Another replica won the race for this (owner_id, correlation_id).
            lease = reservation.lease
            existing = await self.find_request(lease.owner_id, lease.correlation_id)
            if existing is None:
                raise
            raise DuplicateRequest(existing.lease_id) from exc

    async def activate(
        self, lease_id: str, *, endpoint: str, provider_token: str, now: int
    ) -> LeaseRecord | None:
        """provisioning → active. None when the lease is no longer provisioning (a
        reconciler resolved it meanwhile): the caller must destroy its worker."""
        return await self._transition(
            lease_id,
            (LeaseState.provisioning,),
            state=LeaseState.active.value,
            endpoint=endpoint,
            provider_token=provider_token,
            updated_at=now,
        )

    async def fail(self, lease_id: str, *, error: str, now: int) -> LeaseRecord | None:
        """provisioning → failed (its worker, if any, is already destroyed)."""
        return await self._transition(
            lease_id,
            (LeaseState.provisioning,),
            frees=True,
            state=LeaseState.failed.value,
            release_reason=ReleaseReason.failed.value,
            released_at=now,
            last_error=error[:2000],
            updated_at=now,
        )

    # --- release ---------------------------------------------------------------------

    async def claim_release(
        self, lease_id: str, reason: ReleaseReason, *, now: int,
        check: Callable[[LeaseRecord | None], None] | None = None,
    ) -> LeaseRecord | None:
        """active|releasing → releasing, claimed for one attempt. An explicit release
        of a lease already `releasing` claims it again: the caller wants it gone now.

        In the same transaction, `check` first sees the lease as it is (None: unknown)
        and may refuse by raising."""
        def _tx(conn: Connection) -> LeaseRecord | None:
            if check is not None:
                row = _GET.first(conn, {"b_lease_id": lease_id})
                check(_record(row) if row else None)
            return _transition_tx(
                conn, lease_id, (LeaseState.active, LeaseState.releasing), False,
                {"state": LeaseState.releasing.value, "release_reason": reason.value,
                 "next_attempt_at": now + RELEASE_CLAIM_US, "updated_at": now},
            )

        return await self.db.write(_tx)

    async def release_at_once(
        self, lease_id: str, *, owner: str | None, providers: Sequence[str],
        reason: ReleaseReason, now: int,
    ) -> LeaseRecord | None:
        """active|releasing → released in one statement, for a lease on one of
        `providers` (those with nothing to destroy) that `owner` may release. None when
        that does not describe the lease: `claim_release` then says why, or claims it."""
        statements = _RELEASE_AT_ONCE.get(len(providers))
        if statements is None:
            plain = (
                update(leases)
                .where(
                    _BY_ID, _state_in((LeaseState.active, LeaseState.releasing)),
                    leases.c.provider.in_([bindparam(f"p{i}") for i in range(len(providers))]),
                    leases.c.owner_id.is_(None) | (leases.c.owner_id == bindparam("owner")),
                )
                .values({name: bindparam(f"v_{name}") for name in _RELEASED_COLUMNS})
            )
            statements = _RELEASE_AT_ONCE[len(providers)] = (
                _Prepared(plain), _Prepared(plain.returning(*leases.c)),
                _Prepared(plain.where(leases.c.updated_at == bindparam("b_updated_at"))),
            )
        values = _released_values(now, reason.value)
        params = {f"v_{name}": value for name, value in values.items()}
        params |= {f"p{i}": name for i, name in enumerate(providers)}
        params |= {"b_lease_id": lease_id, "owner": owner}

        # Every write to a lease sets its updated_at: a lease recorded here that still has
        # the updated_at it was written with is still as written, and needs no reading.
        recent = self._recent.pop(lease_id, None)
        taken = self._taken

        def _tx(conn: Connection) -> LeaseRecord | None:
            if conn.dialect.name == "sqlite":
                if recent is not None and statements[2].rowcount(
                    conn, {**params, "b_updated_at": recent.updated_at}
                ):
                    done = _updated(_fields_of(recent), values)
                else:
                    # Read, then update without RETURNING: on SQLite that costs about
                    # half as much (bench/README.md), and nothing else writes between.
                    row = _GET.first(conn, {"b_lease_id": lease_id})
                    if row is None or not statements[0].rowcount(conn, params):
                        return None
                    done = _updated(row, values)
                if taken is not None:
                    taken.wrote(conn, done.provider, freed=done.resource)
                return done
            row = statements[1].first(conn, params)
            if row:
                conn.execute(text(f"NOTIFY {CAPACITY_CHANNEL}"))
            return _record(row) if row else None

        return await self.db.write(_tx)

    async def claim_expired(self, *, now: int, limit: int = 100) -> list[LeaseRecord]:
        """Active leases past `expires_at`, moved to `releasing` (reason `expired`)."""
        def _tx(conn: Connection) -> Any:
            ids = (
                conn.execute(
                    select(leases.c.lease_id)
                    .where(leases.c.state == LeaseState.active.value)
                    .where(leases.c.expires_at <= now)
                    .order_by(leases.c.expires_at)
                    .limit(limit)
                )
            ).scalars().all()
            return _claim_many(
                conn, ids, LeaseState.active, now, release_reason=ReleaseReason.expired.value
            )

        return await self.db.write(_tx)

    async def claim_retries(self, *, now: int, limit: int = 100) -> list[LeaseRecord]:
        """`releasing` leases whose next attempt is due, claimed for one attempt."""
        def _tx(conn: Connection) -> Any:
            ids = (
                conn.execute(
                    select(leases.c.lease_id)
                    .where(leases.c.state == LeaseState.releasing.value)
                    .where(leases.c.next_attempt_at <= now)
                    .order_by(leases.c.next_attempt_at)
                    .limit(limit)
                )
            ).scalars().all()
            return _claim_many(
                conn, ids, LeaseState.releasing, now, next_due_before=now
            )

        return await self.db.write(_tx)

    async def reclaim_releases(self, *, now: int) -> int:
        """Make every `releasing` lease due now. For a process that alone serves the
        store (SQLite), at start-up: the claims it finds were made by a process that is
        gone, and must not delay those releases."""

        def _tx(conn: Connection) -> int:
            return conn.execute(
                update(leases)
                .where(leases.c.state == LeaseState.releasing.value)
                .where(leases.c.next_attempt_at > now)
                .values(next_attempt_at=now)
            ).rowcount

        return await self.db.write(_tx)

    async def finish_release(
        self, lease_id: str, *, now: int, reason: ReleaseReason | None = None
    ) -> LeaseRecord | None:
        values = _released_values(now, reason.value if reason is not None else None)
        return await self._transition(lease_id, (LeaseState.releasing,), frees=True, **values)

    async def release_attempt_failed(
        self, lease_id: str, *, error: str, retry_at: int, now: int
    ) -> LeaseRecord | None:
        def _tx(conn: Connection) -> Any:
            row = (
                conn.execute(
                    update(leases)
                    .where(leases.c.lease_id == lease_id)
                    .where(leases.c.state == LeaseState.releasing.value)
                    .values(
                        release_attempts=leases.c.release_attempts + 1,
                        next_attempt_at=retry_at,
                        last_error=error[:2000],
                        updated_at=now,
                    )
                    .returning(*leases.c)
                )
            ).first()
            return _record(row) if row else None

        return await self.db.write(_tx)

    async def mark_lost(self, lease_id: str, *, now: int) -> LeaseRecord | None:
        """active → released (reason `lost`): its worker vanished on its own."""
        return await self._transition(
            lease_id,
            (LeaseState.active,),
            frees=True,
            state=LeaseState.released.value,
            release_reason=ReleaseReason.lost.value,
            released_at=now,
            updated_at=now,
        )

    async def renew(
        self, lease_id: str, *, expires_at: int, now: int
    ) -> LeaseRecord | None:
        """Move an active, unexpired lease's expiry. None when the lease is not active
        or already past its expiry: a lease is never resurrected."""
        def _tx(conn: Connection) -> Any:
            row = (
                conn.execute(
                    update(leases)
                    .where(leases.c.lease_id == lease_id)
                    .where(leases.c.state == LeaseState.active.value)
                    .where(leases.c.expires_at > now)
                    .values(expires_at=expires_at, updated_at=now)
                    .returning(*leases.c)
                )
            ).first()
            return _record(row) if row else None

        return await self.db.write(_tx)

    # --- reads -----------------------------------------------------------------------

    async def find_request(
        self, owner_id: str | None, correlation_id: str | None
    ) -> LeaseRecord | None:
        """The live (provisioning or active) lease made for this request, if any."""
        if not owner_id or not correlation_id:
            return None
        def _tx(conn: Connection) -> Any:
            row = _FIND_REQUEST.first(
                conn, {"owner_id": owner_id, "correlation_id": correlation_id}
            )
            return _record(row) if row else None

        return await self.db.read(_tx)

    async def search_wire(
        self,
        *,
        states: Sequence[str],
        owner_id: str | None = None,
        kind: str | None = None,
        provider: str | None = None,
        limit: int = 1000,
    ) -> list[dict]:
        """Leases in any of `states` matching the filters, oldest first."""
        query = select(leases).where(leases.c.state.in_(list(states)))
        if owner_id is not None:
            query = query.where(leases.c.owner_id == owner_id)
        if kind is not None:
            query = query.where(leases.c.kind == kind)
        if provider is not None:
            query = query.where(leases.c.provider == provider)
        def _tx(conn: Connection) -> Any:
            rows = conn.execute(query.order_by(leases.c.created_at).limit(limit))
            return [_record(row).wire() for row in rows]

        return await self.db.read(_tx)

    async def count_held(self) -> list[tuple[str, str, str | None, int]]:
        """(provider, gpu, owner_id, n) of live leases: capacity in use and quotas."""
        def _tx(conn: Connection) -> Any:
            rows = conn.execute(
                select(leases.c.provider, leases.c.gpu, leases.c.owner_id, func.count())
                .where(leases.c.state.in_(_LIVE))
                .group_by(leases.c.provider, leases.c.gpu, leases.c.owner_id)
            )
            return [(p, g, o, n) for p, g, o, n in rows]

        return await self.db.read(_tx)


    async def get(self, lease_id: str) -> LeaseRecord | None:
        def _tx(conn: Connection) -> Any:
            row = _GET.first(conn, {"b_lease_id": lease_id})
            return _record(row) if row else None

        return await self.db.read(_tx)

    async def list_wire(self, states: Sequence[LeaseState] = (LeaseState.active,)) -> list[dict]:
        def _tx(conn: Connection) -> Any:
            rows = conn.execute(
                select(leases)
                .where(leases.c.state.in_([s.value for s in states]))
                .order_by(leases.c.created_at)
            )
            return [_record(row).wire() for row in rows]

        return await self.db.read(_tx)

    async def list_wire_json(self, states: Sequence[LeaseState] = (LeaseState.active,)) -> bytes:
        """The JSON array of `list_wire(states)`, byte for byte what JSONResponse renders
        from it, oldest first.

        Loading and encoding 10,000 rows on every listing costs far more than the rows
        themselves, so each lease's encoded JSON is kept and reused while its row is
        unchanged. A row's `Lease` only changes together with its state, updated_at or
        expires_at (every write sets updated_at; an active lease is not otherwise
        written), so one cheap query of those columns tells which encodings are still
        valid; only new or changed leases are loaded and encoded. The cache holds
        exactly the leases of the last listing, so it never outgrows it.

        On SQLite the database first lists those keys as one string (in C, in no
        particular but stable order); when it equals the string the last body was built
        from, exactly the same leases are listed unchanged, and the body is reused."""
        wanted = tuple(s.value for s in states)
        return await self.db.read(self._list_wire_json, wanted)

    def _list_wire_json(self, conn: Connection, wanted: tuple[str, ...]) -> bytes:
        cache = self._wire_cache
        kept: dict[str, tuple[tuple[Any, ...], bytes]] = {}
        parts: list[bytes] = []
        keys: list[str] = []
        missing: dict[str, int] = {}  # lease_id -> its place in `parts`
        consistent = True  # the body shows exactly the rows `keys` lists
        listed = None
        if self.dialect == "sqlite":
            listed = conn.execute(_sqlite_wire_keys(wanted)).scalar_one()
            last = self._wire_body
            if last is not None and last[0] == wanted and last[1] == listed:
                return last[2]
        keyed = conn.execute(
            select(leases.c.lease_id, leases.c.state, leases.c.updated_at, leases.c.expires_at)
            .where(leases.c.state.in_(wanted))
            .order_by(leases.c.created_at)
        ).all()
        for lease_id, state, updated_at, expires_at in keyed:
            keys.append(f"{lease_id} {state} {updated_at} {expires_at}")
            hit = cache.get(lease_id)
            if hit is not None and hit[0] == (state, updated_at, expires_at):
                kept[lease_id] = hit
                parts.append(hit[1])
            else:
                missing[lease_id] = len(parts)
                parts.append(b"")
        if missing:
            query = select(*_WIRE_SELECT).where(leases.c.state.in_(wanted))
            ids = list(missing)
            batches = [
                query.where(leases.c.lease_id.in_(ids[i:i + _WIRE_BATCH]))
                for i in range(0, len(ids), _WIRE_BATCH)
            ] if len(ids) <= _WIRE_FETCH_ALL_OVER else [query]
            for batch in batches:
                for row in conn.execute(batch):
                    place = missing.get(row[0])
                    if place is not None:
                        kept[row[0]] = entry = _wire_fragment(row)
                        parts[place] = entry[1]
                        consistent &= keys[place].endswith(_key_tail(entry[0]))
        self._wire_cache = kept
        if len(kept) < len(parts):
            consistent = False
            parts = [part for part in parts if part]  # left `states` between the queries
        body = b"[" + b",".join(parts) + b"]"
        if listed is not None:
            # Kept only when the key string describes this very body (nothing committed
            # between the two queries).
            consistent = consistent and set(keys) == (set(listed.split(",")) if listed else set())
            self._wire_body = (wanted, listed, body) if consistent else None
        return body

    async def live(self, provider: str | None = None) -> list[LeaseRecord]:
        def _tx(conn: Connection) -> Any:
            query = select(leases).where(leases.c.state.in_(_LIVE))
            if provider is not None:
                query = query.where(leases.c.provider == provider)
            return [_record(row) for row in conn.execute(query)]

        return await self.db.read(_tx)

    async def next_due(self) -> int | None:
        """The earliest moment the sweeper has work: an expiry or a release retry."""
        def _tx(conn: Connection) -> Any:
            expiry = (
                conn.execute(
                    select(func.min(leases.c.expires_at)).where(
                        leases.c.state == LeaseState.active.value
                    )
                )
            ).scalar()
            retry = (
                conn.execute(
                    select(func.min(leases.c.next_attempt_at)).where(
                        leases.c.state == LeaseState.releasing.value
                    )
                )
            ).scalar()
            due = [t for t in (expiry, retry) if t is not None]
            return min(due) if due else None

        return await self.db.read(_tx)

    async def count_by_state(self) -> dict[str, int]:
        def _tx(conn: Connection) -> Any:
            rows = conn.execute(
                select(leases.c.state, func.count()).group_by(leases.c.state)
            )
            return {state: count for state, count in rows}

        return await self.db.read(_tx)

    # --- replicas --------------------------------------------------------------------

    async def heartbeat(self, *, now: int) -> None:
        """Record that this replica is alive."""

        def _tx(conn: Connection) -> None:
            beat = update(replicas).where(replicas.c.replica_id == self.replica_id)
            if conn.execute(beat.values(heartbeat_at=now)).rowcount == 0:
                conn.execute(replicas.insert().values(
                    replica_id=self.replica_id, started_at=now, heartbeat_at=now))
            # Replicas silent for a day are gone for good.
            conn.execute(replicas.delete().where(replicas.c.heartbeat_at < now - _DAY_US))

        await self.db.write(_tx)

    async def alive_replicas(self, *, since: int) -> set[str]:
        """Replicas with a heartbeat at or after `since` (this one always counts)."""

        def _tx(conn: Connection) -> set[str]:
            rows = conn.execute(
                select(replicas.c.replica_id).where(replicas.c.heartbeat_at >= since)
            )
            return set(rows.scalars())

        return await self.db.read(_tx) | {self.replica_id}

    async def try_lock(
        self, name: str, *, ttl_us: int, now: int, holder_gone_before: int | None = None
    ) -> bool:
        """Take (or keep) the named lock for `ttl_us`; False while another replica
        holds it. With `holder_gone_before`, a lock whose holder has not heartbeated
        since then is taken over at once."""

        def _tx(conn: Connection) -> bool:
            free = (locks.c.holder == self.replica_id) | (locks.c.expires_at < now)
            if holder_gone_before is not None:
                # A replica killed in the middle of a pass (kill -9) holds the lock until
                # its TTL (30 s or more) runs out: without this, nobody reconciles
                # meanwhile, and its crashed provisions wait that long too.
                free = free | locks.c.holder.not_in(
                    select(replicas.c.replica_id).where(
                        replicas.c.heartbeat_at >= holder_gone_before)
                )
            taken = conn.execute(
                update(locks)
                .where(locks.c.name == name)
                .where(free)
                .values(holder=self.replica_id, expires_at=now + ttl_us)
            )
            if taken.rowcount:
                return True
            try:
                with conn.begin_nested():
                    conn.execute(locks.insert().values(
                        name=name, holder=self.replica_id, expires_at=now + ttl_us))
            except IntegrityError:
                return False  # held by another replica
            return True

        return await self.db.write(_tx)

    async def unlock(self, name: str) -> None:
        def _tx(conn: Connection) -> None:
            conn.execute(locks.delete().where(locks.c.name == name,
                                              locks.c.holder == self.replica_id))

        await self.db.write(_tx)

    async def listen_capacity(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever any replica frees capacity, until cancelled
        (PostgreSQL; SQLite has one process, which knows already)."""
        await self.db.listen(CAPACITY_CHANNEL, callback)

    # --- internals -------------------------------------------------------------------

    async def _transition(
        self, lease_id: str, expected: Sequence[LeaseState], *, frees: bool = False,
        **values: Any,
    ) -> LeaseRecord | None:
        return await self.db.write(_transition_tx, lease_id, expected, frees, values)


@dataclass(slots=True)
class _Reservation:
    """One reserve transaction (see LeaseStore.reserve and reserve_active)."""

    lease: NewLease
    provider: str
    max_live: int
    resources: Sequence[str] | None
    now: int
    owner_quota: int
    resource_label: str
    replica_id: str
    assign: Callable[[str | None], tuple[str, str]] | None = None
    # No earlier reserve of this lease wrote its row: insert without looking first.
    first_try: bool = False
    taken: _TakenCache | None = None

    def run(self, conn: Connection) -> Any:
        lease = self.lease
        # PostgreSQL: serialise per owner (quota, idempotency), then per provider (its
        # cap and GPU devices) across replicas. SQLite has one writer anyway.
        if lease.owner_id:
            _lock(conn, f"owner:{lease.owner_id}")
        _lock(conn, f"provider:{self.provider}")
        mine = {"b_lease_id": lease.lease_id}
        if lease.owner_id and lease.correlation_id:
            twin = _TWIN.scalar(conn, {**mine, "owner_id": lease.owner_id,
                                       "correlation_id": lease.correlation_id})
            if twin is not None:
                raise DuplicateRequest(twin)
        if lease.owner_id and self.owner_quota:
            held = _HELD_BY_OWNER.scalar(conn, {**mine, "owner_id": lease.owner_id})
            if held >= self.owner_quota:
                raise OverQuota(
                    f"owner {lease.owner_id!r} holds {held} leases; "
                    f"MAX_LEASES_PER_OWNER is {self.owner_quota}"
                )
        live_on = {**mine, "provider": self.provider}
        if self.max_live:
            count = _COUNT_LIVE.scalar(conn, live_on)
            if count >= self.max_live:
                raise AtCapacity(f"at capacity ({count}/{self.max_live} live workers)")
        resource = None
        if self.resources is not None:
            if self.first_try and self.taken is not None:
                taken = self.taken.taken(conn, live_on)
            else:
                taken = set((_TAKEN_NEW if self.first_try else _TAKEN).scalars(conn, live_on))
            resource = next((r for r in self.resources if r not in taken), None)
            if resource is None:
                raise AtCapacity(f"all {len(self.resources)} {self.resource_label} are leased")
        values = {
            "provider": self.provider,
            "state": LeaseState.provisioning.value,
            "resource": resource,
            "updated_at": self.now,
            "replica_id": self.replica_id,
        }
        if self.assign is not None:
            values["state"] = LeaseState.active.value
            values["endpoint"], values["provider_token"] = self.assign(resource)
        if not self.first_try:
            # Moved from a provider that failed to provision it (or new after all).
            if self.assign is None:
                if _MOVE.rowcount(conn, {**mine, **{f"v_{k}": v for k, v in values.items()}}):
                    return resource
            else:
                moved = _transition_tx(conn, lease.lease_id, (LeaseState.provisioning,),
                                       False, values)
                if moved is not None:
                    return moved
        row = {
            **_NEW_ROW, "v_lease_id": lease.lease_id, "v_kind": lease.kind,
            "v_gpu": lease.gpu, "v_owner_id": lease.owner_id,
            "v_correlation_id": lease.correlation_id, "v_region": lease.region,
            "v_ttl_seconds": lease.ttl_seconds, "v_created_at": lease.created_at,
            "v_expires_at": lease.expires_at,
            **{f"v_{name}": value for name, value in values.items()},
        }
        _INSERT.rowcount(conn, row)
        if self.taken is not None:
            self.taken.wrote(conn, self.provider, took=resource)  # None: took none
        return resource if self.assign is None else _record([row[k] for k in _INSERTED])


# A new lease row before its own values: every parameter of _INSERT.
_NEW_ROW: dict[str, Any] = {f"v_{name}": None for name in _COLUMNS} | {
    "v_endpoint": "", "v_provider_token": "", "v_release_attempts": 0,
}


# Columns a `Lease` is made of, then the cache key (state, updated_at, expires_at).
_WIRE_SELECT = (
    leases.c.lease_id, leases.c.provider, leases.c.kind, leases.c.endpoint,
    leases.c.created_at, leases.c.expires_at, leases.c.provider_token, leases.c.owner_id,
    leases.c.gpu, leases.c.correlation_id, leases.c.region, leases.c.state,
    leases.c.release_reason, leases.c.released_at, leases.c.updated_at,
)
# More missing leases than this: load every listed row in one query, not by id.
_WIRE_FETCH_ALL_OVER = 1000
_WIRE_BATCH = 500
# What starlette's JSONResponse.render uses, so both paths give the same bytes.
_WIRE_ENCODER = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
)


def _wire_fragment(row: Any) -> tuple[tuple[Any, ...], bytes]:
    """(cache key, encoded Lease) of a row of _WIRE_SELECT; the same dict as
    LeaseRecord.wire(), built from the tuple without a LeaseRecord."""
    (lease_id, provider, kind, endpoint, created_at, expires_at, provider_token, owner_id,
     gpu, correlation_id, region, state, release_reason, released_at, updated_at) = row
    wire = {
        "lease_id": lease_id,
        "provider": provider,
        "kind": kind,
        "endpoint": endpoint,
        "created_at": format_us(created_at),
        "expires_at": format_us(expires_at),
        "provider_token": provider_token,
        "owner_id": owner_id,
        "gpu": gpu,
        "correlation_id": correlation_id,
        "region": region,
        "state": state,
        "release_reason": release_reason,
        "released_at": None if released_at is None else format_us(released_at),
    }
    return (state, updated_at, expires_at), _WIRE_ENCODER.encode(wire).encode()


def _key_tail(key: tuple[Any, ...]) -> str:
    state, updated_at, expires_at = key
    return f" {state} {updated_at} {expires_at}"


def _sqlite_wire_keys(states: Sequence[str]) -> Any:
    """One string of "lease_id state updated_at expires_at" for each lease in `states`,
    comma-separated, in index order (not sorted: that would cost more than the rest);
    each item is the text list_wire_json builds for the lease."""
    key = (
        leases.c.lease_id + " " + leases.c.state + " " + cast(leases.c.updated_at, String)
        + " " + cast(leases.c.expires_at, String)
    )
    return select(func.coalesce(func.group_concat(key, ","), "")).where(
        leases.c.state.in_(states)
    )


def _claim_many(
    conn: Connection,
    ids: Sequence[str],
    expected: LeaseState,
    now: int,
    *,
    next_due_before: int | None = None,
    **values: Any,
) -> list[LeaseRecord]:
    """Move each lease of `ids` still in `expected` to `releasing`, claimed for one
    attempt; the rows actually claimed (a racing claimer may have won some)."""
    claimed = []
    for lease_id in ids:
        query = (
            update(leases)
            .where(leases.c.lease_id == lease_id)
            .where(leases.c.state == expected.value)
        )
        if next_due_before is not None:
            query = query.where(leases.c.next_attempt_at <= next_due_before)
        row = conn.execute(
            query.values(
                state=LeaseState.releasing.value,
                next_attempt_at=now + RELEASE_CLAIM_US,
                updated_at=now,
                **values,
            ).returning(*leases.c)
        ).first()
        if row:
            claimed.append(_record(row))
    return claimed


def _record(row: Any) -> LeaseRecord:
    # Positional: rows come from `select(leases)` / `returning(*leases.c)`, whose column
    # order is the field order (checked below); `row._mapping` per field is 10x slower.
    return LeaseRecord(*row)


assert [f.name for f in fields(LeaseRecord)] == _COLUMNS, "LeaseRecord fields != leases columns"
_PLACE = {name: place for place, name in enumerate(_COLUMNS)}
# A record's fields as a row (column order).
_fields_of = operator.attrgetter(*_COLUMNS)


def _updated(row: Any, values: dict[str, Any]) -> LeaseRecord:
    """The lease of `row` once `values` (column: value) are written."""
    columns = list(row)
    for name, value in values.items():
        columns[_PLACE[name]] = value
    return LeaseRecord(*columns)


def _upgrade(connection: Connection) -> None:
    # Replicas starting together on a fresh database must not migrate it twice at once.
    _lock(connection, "migrate")
    config = Config()
    config.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


def _lock(conn: Connection, key: str) -> None:
    """A transaction-scoped lock on `key` across replicas (PostgreSQL only)."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _lock_id(key)})


def _lock_id(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big", signed=True)
