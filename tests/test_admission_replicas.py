"""The admission loop under load and failure (issue 36): its leader killed with a line
waiting, on two replicas of one PostgreSQL; and a line of 1,000 callers of mixed
classes and shapes served as rooms free one by one. Static endpoints throughout: only
who gets which room matters here (tests/test_admission.py has each case of the issue)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections import Counter, defaultdict
from typing import Any

import httpx
import pytest

from tests.harness import SECRET, TLS, Scheduler, wait_for
from tests.test_admission import line_of, release, served, wait_line
from tests.test_lease_features import acquire_in_thread
from tests.test_replicas import Replicas, replicas  # noqa: F401 - a fixture

THREE = "renderer=http://r1:8080,http://r2:8080,http://r3:8080"


def admission_leader(group: list[Scheduler], ids: dict[str, Scheduler]) -> Scheduler:
    """The replica holding the store's `admission` lock (its row in `locks`), known by
    its replica id (`ids`)."""
    url = group[0].env["DATABASE_URL"]

    def holder() -> str:
        out = subprocess.run(
            [
                "psql",
                "-d",
                url,
                "-tAc",
                "SELECT holder FROM locks WHERE name = 'admission'",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        return out.stdout.strip()

    found = wait_for(lambda: holder() in ids and holder(), 30, 0.1, what="a leader")
    return ids[found]


@pytest.mark.timeout(240)
def test_the_leader_killed_with_a_line_waiting_another_takes_over_and_serves_each_once(
    replicas: Replicas,  # noqa: F811 - the fixture
) -> None:
    group = replicas(PROVIDERS="static", STATIC_WORKERS=THREE, LINE_AGING_SECONDS="86400")
    a, b = group
    held = [group[i % 2].lease(owner_id="holder", ttl_seconds=600) for i in range(3)]
    # One caller on each replica first: the line says which replica id is whose.
    probes = {
        s: acquire_in_thread(s, owner_id="probe", correlation_id=f"p{i}", wait_seconds=300)
        for i, s in enumerate(group)
    }
    shown = wait_line(a, 2)
    ids = {w["replica"]: group[int(w["correlation_id"][1:])] for w in shown}
    leader = admission_leader(group, ids)
    survivor = b if leader is a else a
    waiters = []
    for i in range(6):
        waiters.append(
            acquire_in_thread(
                survivor, owner_id="w", correlation_id=f"w{i}", wait_seconds=300, ttl_seconds=600
            )
        )
        wait_line(survivor, 3 + i)

    leader.kill()
    with pytest.raises(httpx.HTTPError):
        probes[leader].response(30)
    # The dead replica's caller leaves the line with it; the living stay, in order.
    mine = f"p{group.index(survivor)}"
    wait_for(
        lambda: (
            [w["correlation_id"] for w in line_of(survivor)] == [mine, *(f"w{i}" for i in range(6))]
        ),
        30,
        0.2,
        what="the dead replica's caller out of line",
    )

    # Each room freed goes to the next caller, through the new leader.
    current = list(held)
    callers = [probes[survivor], *waiters]
    got = []
    for caller in callers:
        release(survivor, current.pop(0))
        lease = served(caller, 60)
        got.append(lease)
        current.append(lease)
    assert line_of(survivor) == []
    every = survivor.http.get(
        "/v1/leases", params={"state": ["active", "released"], "limit": 1000}
    ).json()
    asked = Counter(x["correlation_id"] for x in every if x["owner_id"] in ("w", "probe"))
    assert all(n == 1 for n in asked.values()), asked  # nobody served twice
    assert len({x["lease_id"] for x in got}) == len(callers)
    assert sorted(x["endpoint"] for x in survivor.leases()) == sorted(
        ["http://r1:8080", "http://r2:8080", "http://r3:8080"]
    ), "a room was lost or given twice"


# --- a line of 1,000 ---------------------------------------------------------------------

SHAPES = [("renderer", "none"), ("anim", "none"), ("renderer", "mid")]
ONE_EACH = "renderer=http://r:8080;anim=http://a:8080;renderer:mid=http://g:8080"
OWNERS = {"hi": "high", "mid": "default", "lo": "low"}


async def _ask(port: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST /v1/lease on a raw connection of its own (one client per caller, as callers
    are: 1,000 httpx clients would cost the test more than the service): its status and
    body."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/lease HTTP/1.1\r\nHost: scheduler\r\nContent-Type: application/json\r\n"
            + f"X-Internal-Secret: {SECRET}\r\nContent-Length: {len(payload)}\r\n".encode()
            + b"Connection: close\r\n\r\n"
            + payload
        )
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        return status, json.loads(await reader.read())
    finally:
        writer.close()


@pytest.mark.timeout(400)
def test_a_thousand_waiters_of_mixed_classes_and_shapes_are_each_served_once_in_order(
    make_scheduler: Any,
) -> None:
    sched = make_scheduler(
        PROVIDERS="static",
        STATIC_WORKERS=ONE_EACH,
        PRIORITY_CLASSES="high=100,default=50,low=10",
        OWNER_PRIORITY_CLASSES="hi=high,lo=low",
        LINE_AGING_SECONDS="86400",
    )
    holders = [sched.lease(kind=k, gpu=g, owner_id="holder", ttl_seconds=600) for k, g in SHAPES]
    owners = list(OWNERS)

    async def run() -> dict[tuple[str, str], list[str]]:
        asks = []
        for i in range(1000):
            kind, gpu = SHAPES[(i * 7) % 3]
            body = {
                "kind": kind,
                "gpu": gpu,
                "owner_id": owners[i % 3],
                "correlation_id": f"c{i}",
                "wait_seconds": 300,
                "ttl_seconds": 60,
            }
            asks.append(asyncio.ensure_future(_ask(sched.port, body)))
            if i % 100 == 99:
                await asyncio.sleep(0)  # let the batch's connections open
        await asyncio.to_thread(wait_line, sched, 1000, 180)
        line = await asyncio.to_thread(line_of, sched)
        expected: dict[tuple[str, str], list[str]] = defaultdict(list)
        for w in line:
            expected[(w["kind"], w["gpu"])].append(w["correlation_id"])
        assert line[0]["priority_class"] == "high" and line[-1]["priority_class"] == "low"

        got: dict[tuple[str, str], list[str]] = defaultdict(list)
        async with httpx.AsyncClient(
            verify=TLS, base_url=sched.url, headers={"X-Internal-Secret": SECRET}, timeout=60
        ) as client:
            for holder in holders:
                gone = await client.delete(
                    f"/v1/lease/{holder['lease_id']}", headers={"X-Lease-Owner": "holder"}
                )
                assert gone.status_code == 204, gone.text
            for answer in asyncio.as_completed(asks):
                status, body = await answer
                assert status == 200, body
                lease = body["lease"]
                got[(lease["kind"], lease["gpu"])].append(lease["correlation_id"])
                # The room is freed at once: the next of its shape is served.
                gone = await client.delete(
                    f"/v1/lease/{lease['lease_id']}",
                    headers={"X-Lease-Owner": lease["owner_id"]},
                )
                assert gone.status_code == 204, gone.text
        assert got == expected
        return got

    got = asyncio.run(run())
    assert sum(len(v) for v in got.values()) == 1000
    assert len({c for v in got.values() for c in v}) == 1000  # each exactly once
    assert line_of(sched) == []
    assert sched.leases() == []
