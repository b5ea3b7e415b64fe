"""The state store. `open_store` chooses the database once, from DATABASE_URL; the
lease logic (leases.py) runs on either backend without asking which. The store decides
nothing: every move it applies, and every set of states it selects by, is the core's
(lifecycle/states.py), handed to it."""

from __future__ import annotations

from sqlalchemy.engine import make_url

from openalice_scheduler.capacity import AtCapacity
from openalice_scheduler.store.backend import Backend
from openalice_scheduler.store.leases import LeaseStore
from openalice_scheduler.store.records import (
    Behind,
    DuplicateRequest,
    LeaseRecord,
    Move,
    NewLease,
    OverBudget,
    OverQuota,
    StateSets,
    Terms,
)
from openalice_scheduler.times import format_us, to_us


def open_backend(database_url: str, *, sqlite_synchronous: str = "full") -> Backend:
    """The backend for `database_url`: SQLite (one process per file) or PostgreSQL."""
    url = make_url(database_url)
    dialect = url.get_backend_name()
    if dialect == "sqlite":
        from openalice_scheduler.store.sqlite import SqliteBackend

        return SqliteBackend(url, synchronous=sqlite_synchronous)
    if dialect in ("postgresql", "postgres"):
        from openalice_scheduler.store.postgres import PostgresBackend

        return PostgresBackend(url)
    raise ValueError(f"DATABASE_URL: unsupported scheme {dialect!r}")


def open_store(
    database_url: str,
    *,
    states: StateSets,
    replica_id: str | None = None,
    sqlite_synchronous: str = "full",
) -> LeaseStore:
    """The store at `database_url`; `states`: the core's sets of states its reads select
    by (lifecycle/states.py STATE_SETS)."""
    backend = open_backend(database_url, sqlite_synchronous=sqlite_synchronous)
    return LeaseStore(backend, states=states, replica_id=replica_id)


__all__ = [
    "AtCapacity",
    "Behind",
    "Backend",
    "DuplicateRequest",
    "LeaseRecord",
    "LeaseStore",
    "Move",
    "NewLease",
    "OverBudget",
    "OverQuota",
    "StateSets",
    "Terms",
    "format_us",
    "open_backend",
    "open_store",
    "to_us",
]
