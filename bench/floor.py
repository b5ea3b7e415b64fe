"""What the parts of a lease round trip cost alone on this host, beside the scheduler
itself, in one run: the floor under bench/replicas.py's figures.

    .venv/bin/python bench/floor.py [--seconds 8] [--clients 32]
                                    [--pg-host /var/run/postgresql]

Four rows, each acquire + release round trips at `--clients` concurrent callers:

- **scheduler**: the service on PostgreSQL, static provider with 1,000 endpoints, as
  bench/replicas.py runs it with one replica.
- **FastAPI alone**: a FastAPI app with the same two calls (`POST /v1/lease` with a
  pydantic body, `DELETE /v1/lease/{id}` answering 204) and nothing behind them: no
  middleware, no store. Served with the scheduler's own uvicorn settings (server.py:
  h11 by default). With `HTTP_PARSER=httptools` the row shows that parser instead.
- **lease SQL on asyncpg alone**: the statements the store sends PostgreSQL for one
  static round trip (read from the server's statement log: BEGIN, the provider's
  advisory lock, the endpoints taken, INSERT ... RETURNING, COMMIT; then BEGIN, the lease
  by id, the guarded UPDATE ... RETURNING, NOTIFY, COMMIT), sent with asyncpg's own pool
  and prepared statements from this process, no SQLAlchemy; the same tables (migrated
  by the store).
- **pgbench**: TPC-B-like, 32 clients, synchronous_commit on (as bench/replicas.py).

CPU ms/round is user + system CPU of the process doing the work (the server process for
the HTTP rows, this process for the SQL row), per round trip. Their sum is what one
scheduler process could not go under with these parts, whatever its own code does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    PYTHON,
    REPO,
    cpu_seconds,
    drive,
    ensure_src_on_path,
    free_port,
    in_process_rate,
    lease_round,
)
from replicas import fresh_database, load, pgbench, replica_set  # noqa: E402

# --- FastAPI alone ---------------------------------------------------------------------


class BareLeaseRequest(BaseModel):
    kind: str
    ttl_seconds: int = 600


def bare_app() -> FastAPI:
    """The two calls of a round trip, with nothing behind them."""
    app = FastAPI()

    @app.post("/v1/lease")
    async def acquire(body: BareLeaseRequest) -> dict[str, Any]:
        return {
            "lease": {
                "lease_id": str(uuid.uuid4()),
                "kind": body.kind,
                "endpoint": "http://w0.static.invalid:8080",
            },
            "provider": "static",
        }

    @app.delete("/v1/lease/{lease_id}", status_code=204)
    async def release(lease_id: str) -> None:
        return None

    return app


def serve_bare(port: int) -> None:
    """Serve `bare_app` with the scheduler's uvicorn settings (server.py)."""
    ensure_src_on_path()
    import uvicorn

    from openalice_scheduler import server

    server.tune_gc()
    uvicorn.run(
        bare_app(),
        host="127.0.0.1",
        port=port,
        **server.http_options(os.environ.get("HTTP_PARSER", "h11")),
    )


def bare_round_trips(clients: int, seconds: float) -> dict[str, float]:
    port = free_port()
    proc = subprocess.Popen([PYTHON, __file__, "--serve-bare", str(port)], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                asyncio.run(asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1))
                break
            except OSError:
                time.sleep(0.2)
        before = cpu_seconds([proc.pid])
        latencies, errors, elapsed = asyncio.run(drive(port, {}, clients, seconds, lease_round))
        cpu = cpu_seconds([proc.pid]) - before
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {
        "rate": len(latencies) / elapsed,
        "cpu_ms": cpu * 1000 / max(1, len(latencies)),
        "errors": errors,
    }


# --- the lease's SQL on asyncpg alone --------------------------------------------------

_LOCK = "SELECT pg_advisory_xact_lock($1)"
_TAKEN = (
    "SELECT resource FROM leases WHERE provider = $1 AND state IN "
    "('provisioning', 'active', 'releasing') AND lease_id != $2 "
    "AND resource IS NOT NULL"
)
_INSERT = (
    "INSERT INTO leases (lease_id, provider, kind, gpu, state, endpoint, provider_token, "
    "resource, ttl_seconds, created_at, expires_at, release_attempts, updated_at, "
    "replica_id) VALUES ($1, 'static', 'renderer', 'none', 'active', $2, $2, $2, 600, $3, "
    "$4, 0, $3, 'floor') RETURNING *"
)
_GET = "SELECT * FROM leases WHERE lease_id = $1"
_RELEASE = (
    "UPDATE leases SET state = 'released', released_at = $2, "
    "release_reason = 'explicit', next_attempt_at = NULL, updated_at = $2 "
    "WHERE lease_id = $1 AND state IN ('active', 'releasing') RETURNING *"
)
ENDPOINTS = [f"http://w{i}.static.invalid:8080" for i in range(1000)]


async def sql_round_trips(url: str, clients: int, seconds: float) -> dict[str, float]:
    import asyncpg

    ensure_src_on_path()
    from openalice_scheduler.lifecycle.states import STATE_SETS
    from openalice_scheduler.store import open_store
    from openalice_scheduler.store.postgres import POOL_MAX, POOL_MIN

    store = open_store(url, states=STATE_SETS)
    await store.migrate()  # the store's own tables and indexes
    await store.close()
    # The store's own pool bounds (store/postgres.py).
    pool = await asyncpg.create_pool(url, min_size=POOL_MIN, max_size=POOL_MAX)

    async def one_round() -> None:
        lease_id, now = str(uuid.uuid4()), time.time_ns() // 1000
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute(_LOCK, 42)
            taken = {r[0] for r in await conn.fetch(_TAKEN, "static", lease_id)}
            endpoint = next(e for e in ENDPOINTS if e not in taken)
            await conn.fetchrow(_INSERT, lease_id, endpoint, now, now + 600_000_000)
        async with pool.acquire() as conn, conn.transaction():
            await conn.fetchrow(_GET, lease_id)
            await conn.fetchrow(_RELEASE, lease_id, now)
            await conn.execute("NOTIFY openalice_capacity")

    try:
        rate, cpu_ms = await in_process_rate(one_round, clients, seconds)
    finally:
        await pool.close()
    return {"rate": rate, "cpu_ms": cpu_ms, "errors": 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--pg-host", default=os.environ.get("PGHOST", "/var/run/postgresql"))
    parser.add_argument("--serve-bare", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare is not None:
        serve_bare(args.serve_bare)
        return
    import uvloop  # as the service runs

    rows: list[tuple[str, dict[str, float]]] = []
    with fresh_database(args.pg_host) as url, replica_set(url, 1) as services:
        rows.append(
            (
                "scheduler (1 replica, PostgreSQL)",
                load(
                    [services[0].url],
                    services[0].secret,
                    args.clients,
                    args.seconds,
                    [services[0].pid],
                ),
            )
        )
    parser_name = os.environ.get("HTTP_PARSER", "h11")
    rows.append(
        (
            f"FastAPI alone ({parser_name}, no middleware, no store)",
            bare_round_trips(args.clients, args.seconds),
        )
    )
    with fresh_database(args.pg_host) as url:
        rows.append(
            (
                "lease SQL on asyncpg alone (10 statements)",
                uvloop.run(sql_round_trips(url, args.clients, args.seconds)),
            )
        )
    reference = pgbench(args.pg_host, args.seconds)

    print(
        f"acquire+release round trips, {args.clients} concurrent callers, "
        f"{args.seconds:g} s each; {os.cpu_count()} CPUs"
    )
    print(f"{'':<52} {'rate/s':>9} {'CPU ms/round':>12} {'errors':>6}")
    for name, row in rows:
        print(f"{name:<52} {row['rate']:>9.1f} {row['cpu_ms']:>12.2f} {row['errors']:>6}")
    floor = rows[1][1]["cpu_ms"] + rows[2][1]["cpu_ms"]
    print(f"{'floor: FastAPI alone + lease SQL alone':<52} {'':>9} {floor:>12.2f}")
    print(
        f"reference: pgbench TPC-B-like, 32 clients, -j 2, synchronous_commit on: "
        f"{reference['tps']:,.0f} tx/s (5 statements each)"
    )


if __name__ == "__main__":
    main()
