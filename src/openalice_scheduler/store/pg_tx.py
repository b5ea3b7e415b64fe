"""The store's transactions on PostgreSQL, run on asyncpg directly.

A transaction of the store is one plain function over a connection (backend.py),
written once for both databases with SQLAlchemy Core statements. On PostgreSQL it gets a
`PgTx`: the part of SQLAlchemy's `Connection` the store uses (`execute(statement,
params)` and `begin_nested()`), on one asyncpg connection inside one transaction.
Each statement is compiled once by SQLAlchemy's own PostgreSQL compiler (the same SQL
its engine would send) and sent as an asyncpg prepared statement; its rows come back
as asyncpg records. What this skips is SQLAlchemy's execution machinery around each
statement, which cost ~220 µs of CPU against ~60 µs for the statement itself
(bench/README.md).

The function is synchronous, so it runs in a greenlet (the `greenlet` package, which
SQLAlchemy's asyncio support is built on): each statement switches to the event loop,
which awaits asyncpg, and switches back with the rows. This is the pattern of
SQLAlchemy's own `greenlet_spawn` / `await_only`, which are not public API.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

import asyncpg
import greenlet
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

T = TypeVar("T")

_DIALECT = asyncpg_dialect()  # type: ignore[no-untyped-call]  # unannotated upstream
# Statements built once (the lease path's) are compiled once; one built per call compiles
# each time, as SQLAlchemy would on a miss. Bounded: per-call statements are new objects.
_COMPILED_KEPT = 512


async def run_in_greenlet(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, where `fn` may call `wait_for` to await on this event loop."""
    outcome: list[T] = []
    worker = greenlet.greenlet(lambda: outcome.append(fn(*args)))
    awaitable = worker.switch()
    while not worker.dead:
        try:
            value = await awaitable
        except BaseException as exc:  # noqa: BLE001 - handed to fn, which may handle it
            awaitable = worker.throw(exc)
        else:
            awaitable = worker.switch(value)
    return outcome[0]


def wait_for(awaitable: Awaitable[T]) -> T:
    """Await `awaitable` from inside `run_in_greenlet`."""
    parent = greenlet.getcurrent().parent
    if parent is None:
        raise RuntimeError("wait_for() outside run_in_greenlet()")
    result: T = parent.switch(awaitable)
    return result


class Rows:
    """A statement's rows, with the part of SQLAlchemy's `Result` the store uses."""

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rows: Sequence[Any], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)

    def all(self) -> list[Any]:
        return list(self._rows)

    def first(self) -> Any:
        return self._rows[0] if self._rows else None

    def one(self) -> Any:
        if len(self._rows) != 1:
            raise ValueError(f"expected one row, got {len(self._rows)}")
        return self._rows[0]

    def scalar(self) -> Any:
        return self._rows[0][0] if self._rows else None

    def scalar_one(self) -> Any:
        return self.one()[0]

    def scalars(self) -> Rows:
        return Rows([row[0] for row in self._rows], self.rowcount)


class PgTx:
    """One transaction's statements on one asyncpg connection (see the module's text)."""

    def __init__(self, connection: asyncpg.Connection) -> None:
        self.connection = connection

    def execute(self, statement: ClauseElement, params: Mapping[str, Any] | None = None) -> Rows:
        compiled, sql, names, returns_rows = _compile(statement, tuple(params or ()))
        if params is not None and all(name in params for name in names):
            args = [params[name] for name in names]  # the lease path: all bound by name
        else:  # values of the statement's own, or column defaults: SQLAlchemy's to add
            values = compiled.construct_params(params)
            args = [values[name] for name in names]
        try:
            if returns_rows:
                rows = wait_for(self.connection.fetch(sql, *args))
                return Rows(rows, len(rows))
            status = wait_for(self.connection.execute(sql, *args))
        except asyncpg.IntegrityConstraintViolationError as exc:
            # As SQLAlchemy raises it, so the lease logic's handling holds on both databases.
            raise IntegrityError(sql, None, exc) from exc
        # The command tag: `UPDATE 3`, `INSERT 0 1`, `DELETE 0`.
        count = status.rsplit(" ", 1)[-1]
        return Rows([], int(count) if count.isdigit() else 0)

    @contextlib.contextmanager
    def begin_nested(self) -> Iterator[None]:
        """A savepoint: an error inside undoes only what was done inside."""
        savepoint = self.connection.transaction()
        wait_for(savepoint.start())
        try:
            yield
        except BaseException:
            wait_for(savepoint.rollback())
            raise
        wait_for(savepoint.commit())


@functools.lru_cache(maxsize=_COMPILED_KEPT)
def _compile(statement: ClauseElement, keys: tuple[str, ...]) -> tuple[Any, str, list[str], bool]:
    """SQLAlchemy's PostgreSQL SQL for `statement` run with parameters `keys` (an INSERT
    or UPDATE without values of its own sets exactly those columns): the compiled form,
    its text, the order of its positional parameters, and whether it returns rows."""
    compiled = cast(
        SQLCompiler,
        statement.compile(
            dialect=_DIALECT, column_keys=list(keys), compile_kwargs={"render_postcompile": True}
        ),
    )
    is_dml = getattr(statement, "is_dml", False)
    returns_rows = not is_dml or bool(getattr(statement, "exported_columns", ()))
    return compiled, compiled.string, list(compiled.positiontup or ()), returns_rows
