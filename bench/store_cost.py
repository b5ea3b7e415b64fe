"""The store's own cost on PostgreSQL, without HTTP: static acquire + release round trips
(the core's `assign` reservation, then `claim_release`) through one `LeaseStore` on a
fresh database, with 1, 8 and 32 concurrent callers; the CPU time of this process per
round trip.

    .venv/bin/python bench/store_cost.py [--seconds 5] [--clients 1,8,32]
                                         [--pg-host /var/run/postgresql]

This process's CPU is the store's (SQLAlchemy, asyncpg, the lease logic); PostgreSQL's
own is not counted. Each level gets its own database (dropped at the end) and is bounded
by --seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import in_process_rate  # noqa: E402
from replicas import STATIC_ENDPOINTS, fresh_database  # noqa: E402

from openalice_scheduler.ids import new_lease_id  # noqa: E402
from openalice_scheduler.lifecycle import admission, states  # noqa: E402
from openalice_scheduler.lifecycle.states import STATE_SETS  # noqa: E402
from openalice_scheduler.models import ReleaseReason  # noqa: E402
from openalice_scheduler.store import NewLease, Terms, open_store  # noqa: E402

ENDPOINTS = [f"http://w{i}.static.invalid:8080" for i in range(STATIC_ENDPOINTS)]


async def run(url: str, clients: int, seconds: float) -> tuple[float, float]:
    """(round trips per second, CPU ms per round trip) with `clients` callers."""
    store = open_store(url, states=STATE_SETS)
    await store.migrate()

    async def one_round() -> None:
        now = time.time_ns() // 1000
        lease = NewLease(
            lease_id=new_lease_id(),
            kind="renderer",
            gpu="none",
            owner_id=None,
            correlation_id=None,
            region=None,
            ttl_seconds=60,
            created_at=now,
            expires_at=now + 60_000_000,
        )
        terms = Terms(now=now, resources=ENDPOINTS, resource_label="static endpoints")
        await store.reserve(
            lease, admission.reserve(lease, "static", terms, states.ASSIGN, lambda r: (r, r))
        )
        done = await store.claim_release(
            lease.lease_id,
            ReleaseReason.explicit,
            states.RELEASE,
            now=now,
            at_once=(states.RELEASE_AT_ONCE, ("static",)),
        )
        assert done is not None and done.state == "released"

    try:
        return await in_process_rate(one_round, clients, seconds)
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--pg-host", default=os.environ.get("PGHOST", "/var/run/postgresql"))
    args = parser.parse_args()
    import uvloop  # as the service runs

    print(
        f"store only (no HTTP), static acquire+release on PostgreSQL, {args.seconds:g} s "
        f"per level; {os.cpu_count()} CPUs"
    )
    print(f"{'clients':>7} {'rate/s':>9} {'CPU ms/round':>12}")
    for clients in (int(c) for c in args.clients.split(",")):
        with fresh_database(args.pg_host) as url:
            rate, cpu_ms = uvloop.run(run(url, clients, args.seconds))
        print(f"{clients:>7} {rate:>9.1f} {cpu_ms:>12.2f}")


if __name__ == "__main__":
    main()
