"""The admission loop (docs/concepts/priorities.md#the-admission-loop), measured over real
HTTP against the real service with a static pool of `--rooms` endpoints, so that only
admission is measured (no worker is made or probed). Three figures:

1. **Admissions per second from a line of `--waiters`** (1,000). The pool is held by the
   bench, `--waiters` callers of mixed classes (1 in 10 `live`, 5 in 10 `default`, 4 in
   10 `anim`, each through an owner of that class) wait in line (`wait_seconds` 300, the most),
   each on a connection of its own. Then every held lease is released at once, and each
   caller, as soon as it is answered, releases its lease (so the room goes to the next in
   line). The rate is callers answered per second, from the releases to the last answer
   (end to end: the DELETE, the loop's pass, the grant's transaction, the caller's
   replica reading the decision, the answer read here). With `--one-by-one`, the same
   with a pool of one endpoint: each room freed alone, a pass per caller. The reference:
   Kueue's published baseline, about 43 workloads/s (see REFERENCE below).
2. **The cost of one admission as the line grows** (`--lines` 10,100,1000,5000; the
   line's bound MAX_WAITING_CALLERS raised to fit). With the pool held and a line of L
   waiting, one held lease is released and the time from its DELETE being sent to the
   answer of the caller it went to is taken; the line is topped up to L again before
   the next sample (`--samples` per L). Median and p99 per L.
3. **`GET /health` p99 while the line moves**, beside the same on the idle service (the
   HTTP floor), measured in the same run by a probe process of its own (one kept-alive
   connection, a request every 20 ms), so the bench's own callers do not slow it.

Each configuration runs on SQLite (one scheduler), and, unless `--skip-pg`, on two
replicas sharing one PostgreSQL database (a fresh one on `--pg-host`, dropped at the
end; the callers split between the replicas, the leases released through either).

    .venv/bin/python bench/admission.py [--waiters 1000] [--rooms 50] [--samples 30]
                                        [--lines 10,100,1000,5000] [--one-by-one]
                                        [--skip-pg] [--pg-host /var/run/postgresql]

Classes are `live=100,default=50,anim=10:preemptible`, none of them preempting: the
bench measures admission, not preemption (bench/priorities.py measures that).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import HttpConnection, Service, percentile  # noqa: E402
from replicas import fresh_database, replica_set  # noqa: E402

# Kueue's scheduler performance baseline (test/performance/scheduler in
# kubernetes-sigs/kueue): configs/baseline/generator.yaml makes 5 cohorts x 6 cluster
# queues x (350 + 100 + 50) workloads = 15,000 workloads, and configs/baseline/
# rangespec.yaml gives the average wall time of five runs, 351,116 ms: ~42.7 admitted
# workloads per second (with their simulated run times and an API server in between,
# so not the same measure as here: the order of magnitude to be well past).
# https://github.com/kubernetes-sigs/kueue/blob/main/test/performance/scheduler/configs/baseline/generator.yaml
# https://github.com/kubernetes-sigs/kueue/blob/main/test/performance/scheduler/configs/baseline/rangespec.yaml
REFERENCE = ("Kueue baseline (15,000 workloads in 351 s)", 15_000 / 351.116)

LIVE_OWNERS = [f"live-{i}" for i in range(20)]
ANIM_OWNERS = [f"anim-{i}" for i in range(40)]
DEFAULT_OWNERS = [f"team-{i}" for i in range(40)]  # unlisted: `default` at most
CLASSES = {
    "PRIORITY_CLASSES": "live=100,default=50,anim=10:preemptible",
    "OWNER_PRIORITY_CLASSES": ",".join(
        [f"{o}=live" for o in LIVE_OWNERS] + [f"{o}=anim" for o in ANIM_OWNERS]
    ),
}
PROBE_EVERY_S = 0.02

Answers = asyncio.Queue[tuple[float, "Caller | Exception"]]


def owner_of(i: int) -> str:
    """Caller i's owner: 1 in 10 live, 5 in 10 default, 4 in 10 anim."""
    k = i % 10
    if k == 0:
        return LIVE_OWNERS[i // 10 % len(LIVE_OWNERS)]
    if k <= 5:
        return DEFAULT_OWNERS[i % len(DEFAULT_OWNERS)]
    return ANIM_OWNERS[i % len(ANIM_OWNERS)]


# --- the /health probe, a process of its own ------------------------------------------


async def _probe(port: int, out: Path) -> None:
    http = HttpConnection(port)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    with open(out, "a") as sink:
        while not stop.is_set():
            started = time.perf_counter()
            await http.request("GET", "/health")
            sink.write(f"{time.perf_counter() - started:.6f}\n")
            sink.flush()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PROBE_EVERY_S)
    await http.close()


@contextlib.contextmanager
def health_probe(service: Service) -> Iterator[list[float]]:
    """`GET /health` latencies (s) taken while the block runs, by a probe process."""
    found: list[float] = []
    with tempfile.NamedTemporaryFile(prefix="oa-bench-probe-", delete=False) as f:
        out = Path(f.name)
    proc = subprocess.Popen([sys.executable, __file__, "--probe", str(service.port), str(out)])
    try:
        yield found
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        found += [float(x) for x in out.read_text().split()]
        out.unlink(missing_ok=True)


def idle_health(service: Service, seconds: float = 5.0) -> list[float]:
    with health_probe(service) as found:
        time.sleep(seconds)
    return found


# --- callers ---------------------------------------------------------------------------


class Caller:
    """One caller in line on a connection of its own: its acquire, answered into
    `answers` as (time answered, lease id, this caller)."""

    def __init__(self, service: Service, i: int) -> None:
        self.service = service
        self.owner = owner_of(i)
        self.http = HttpConnection(
            service.port, {"X-Internal-Secret": service.secret, "X-Lease-Owner": self.owner}
        )
        self.lease_id: str | None = None

    async def acquire(self, answers: Answers) -> None:
        body = json.dumps(
            {"kind": "renderer", "wait_seconds": 300, "ttl_seconds": 3600, "owner_id": self.owner}
        ).encode()
        status, raw = await self.http.request("POST", "/v1/lease", body)
        answered = time.perf_counter()
        if status != 200:
            error = RuntimeError(f"a caller in line was answered {status}: {raw[:300]!r}")
            answers.put_nowait((answered, error))
            raise error
        self.lease_id = json.loads(raw)["lease"]["lease_id"]
        answers.put_nowait((answered, self))

    async def release(self) -> None:
        assert self.lease_id is not None
        status, raw = await self.http.request("DELETE", f"/v1/lease/{self.lease_id}")
        if status != 204:
            raise RuntimeError(f"release answered {status}: {raw[:300]!r}")

    async def close(self) -> None:
        await self.http.close()


def waiting(services: list[Service]) -> int:
    total = 0.0
    for service in services:
        text = httpx.get(f"{service.url}/metrics", timeout=30).text
        total += sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("scheduler_waiting_callers_per_class{")
        )
    return int(total)


async def until_waiting(services: list[Service], n: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while await asyncio.to_thread(waiting, services) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {n} callers got in line in {timeout:.0f} s")
        await asyncio.sleep(0.05)


async def hold_pool(services: list[Service], rooms: int) -> list[Caller]:
    """Every endpoint of the pool leased by the bench (no owner: nobody waits yet)."""
    held = []
    for i in range(rooms):
        caller = Caller(services[i % len(services)], i)
        answers: Answers = asyncio.Queue()
        await caller.acquire(answers)
        held.append(caller)
    return held


async def answer(answers: Answers, timeout: float) -> tuple[float, Caller]:
    """The next caller answered, and when; a caller refused ends the run."""
    answered, caller = await asyncio.wait_for(answers.get(), timeout)
    if isinstance(caller, Exception):
        raise caller
    return answered, caller


async def join(
    services: list[Service], n: int, start: int, answers: Answers
) -> tuple[list[Caller], list[asyncio.Task[None]]]:
    """`n` more callers in line, 200 at a time, each batch in line before the next
    connects (thousands of connections at once overflow the listen backlog of a server
    sharing 2 busy cores: resets)."""
    already = await asyncio.to_thread(waiting, services) if n > 1 else 0
    callers = [Caller(services[(start + i) % len(services)], start + i) for i in range(n)]
    tasks = []
    for k, caller in enumerate(callers):
        tasks.append(asyncio.create_task(caller.acquire(answers)))
        if k % 200 == 199 and k + 1 < n:
            await until_waiting(services, already + k + 1)
    return callers, tasks


# --- 1. the line drained --------------------------------------------------------------


async def drain(services: list[Service], waiters: int, rooms: int) -> dict[str, Any]:
    held = await hold_pool(services, rooms)
    answers: Answers = asyncio.Queue()
    callers, tasks = await join(services, waiters, rooms, answers)
    await until_waiting(services, waiters)
    with health_probe(services[0]) as health:
        started = time.perf_counter()
        await asyncio.gather(*(h.release() for h in held))
        times = []
        releases = []
        for _ in range(waiters):
            answered, caller = await answer(answers, 300)
            times.append(answered - started)
            releases.append(asyncio.create_task(caller.release()))
        await asyncio.gather(*releases, *tasks)
    for caller in held + callers:
        await caller.close()
    times.sort()
    tenth = len(times) // 10
    middle = (times[-tenth - 1] - times[tenth]) / max(1, len(times) - 2 * tenth - 1)
    return {
        "waiters": waiters,
        "rooms": rooms,
        "seconds": times[-1],
        "rate": waiters / times[-1],
        "rate_middle": 1 / middle if middle > 0 else float("inf"),
        "health": health,
    }


# --- 2. one admission as the line grows -----------------------------------------------


async def one_admission(
    services: list[Service], line: int, rooms: int, samples: int
) -> dict[str, Any]:
    held = await hold_pool(services, rooms)
    answers: Answers = asyncio.Queue()
    callers, tasks = await join(services, line, rooms, answers)
    await until_waiting(services, line)
    took = []
    next_i = rooms + line
    with health_probe(services[0]) as health:
        for s in range(samples):
            freed = held.pop(s % len(held))
            started = time.perf_counter()
            await freed.release()
            answered, caller = await answer(answers, 120)
            took.append(answered - started)
            held.append(caller)
            await freed.close()
            more, more_tasks = await join(services, 1, next_i, answers)
            next_i += 1
            callers += more
            tasks += more_tasks
            await until_waiting(services, line)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for caller in held + callers:
        await caller.close()
    return {
        "line": line,
        "samples": samples,
        "p50": percentile(took, 50),
        "p99": percentile(took, 99),
        "max": max(took),
        "health": health,
    }


# --- the services ----------------------------------------------------------------------


def _endpoints(n: int) -> str:
    return ",".join(f"http://w{i}.static.invalid:8080" for i in range(n))


def _env(rooms: int, most: int) -> dict[str, str]:
    return {
        "PROVIDERS": "static",
        "STATIC_WORKERS": f"renderer={_endpoints(rooms)}",
        "MAX_WAITING_CALLERS": str(max(1000, most)),
        "MAX_WAITING_PER_OWNER": str(max(500, most)),
        # The endpoints are names that do not resolve: never probed (a probe that fails
        # three times takes an endpoint out of rotation and ends its lease `lost`).
        "STATIC_PROBE_INTERVAL_SECONDS": "0",
        "LOG_LEVEL": "WARNING",
        **CLASSES,
    }


@contextlib.contextmanager
def sqlite_service(rooms: int, most: int) -> Iterator[list[Service]]:
    with Service("adm", **_env(rooms, most)) as service:
        service.start()
        yield [service]


@contextlib.contextmanager
def pg_replicas(pg_host: str, rooms: int, most: int) -> Iterator[list[Service]]:
    env = _env(rooms, most)
    del env["PROVIDERS"], env["STATIC_WORKERS"]
    with fresh_database(pg_host) as url, replica_set(url, 2, rooms, **env) as services:
        yield services


def _ms(values: list[float]) -> str:
    if not values:
        return "no samples"
    return (
        f"p50 {percentile(values, 50) * 1e3:7.2f} ms   p99 {percentile(values, 99) * 1e3:7.2f} ms"
        f"   (n={len(values)})"
    )


def run(store: str, make: Any, args: argparse.Namespace) -> None:
    lines = [int(x) for x in args.lines.split(",") if x]
    print(f"== {store} (load average {os.getloadavg()[0]:.1f})", flush=True)
    with make(args.rooms, args.waiters) as services:
        idle = idle_health(services[0])
        print(f"  GET /health, idle service (the floor):    {_ms(idle)}", flush=True)
        d = asyncio.run(drain(services, args.waiters, args.rooms))
        print(
            f"  line of {d['waiters']} drained through a pool of {d['rooms']}: "
            f"{d['seconds']:.2f} s, {d['rate']:,.0f} admissions/s "
            f"(middle 80 %: {d['rate_middle']:,.0f}/s)",
            flush=True,
        )
        print(f"  GET /health while it drained:              {_ms(d['health'])}", flush=True)
    if args.one_by_one:
        with make(1, args.waiters) as services:
            d = asyncio.run(drain(services, args.waiters, 1))
            print(
                f"  line of {d['waiters']} drained one room at a time (pool of 1): "
                f"{d['seconds']:.2f} s, {d['rate']:,.0f} admissions/s",
                flush=True,
            )
            print(f"  GET /health while it drained:              {_ms(d['health'])}", flush=True)
    for line in lines:
        with make(args.rooms, line) as services:
            r = asyncio.run(one_admission(services, line, args.rooms, args.samples))
        print(
            f"  line of {line:>5}: room freed -> its caller answered  "
            f"p50 {r['p50'] * 1e3:7.2f} ms   p99 {r['p99'] * 1e3:7.2f} ms   "
            f"max {r['max'] * 1e3:7.2f} ms (n={r['samples']});  /health {_ms(r['health'])}",
            flush=True,
        )
    print(f"  (load average at the end {os.getloadavg()[0]:.1f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiters", type=int, default=1000)
    parser.add_argument("--rooms", type=int, default=50)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--lines", default="10,100,1000,5000")
    parser.add_argument("--one-by-one", action="store_true")
    parser.add_argument("--skip-sqlite", action="store_true")
    parser.add_argument("--skip-pg", action="store_true")
    parser.add_argument("--pg-host", default=os.environ.get("PGHOST", "/var/run/postgresql"))
    args = parser.parse_args()
    print(
        f"admission over HTTP, static pool; {os.cpu_count()} CPUs; "
        f"reference: {REFERENCE[0]}: {REFERENCE[1]:.1f} workloads/s",
        flush=True,
    )
    if not args.skip_sqlite:
        run("SQLite, one scheduler", sqlite_service, args)
    if not args.skip_pg:
        run(
            "PostgreSQL, two replicas",
            lambda rooms, most: pg_replicas(args.pg_host, rooms, most),
            args,
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        asyncio.run(_probe(int(sys.argv[2]), Path(sys.argv[3])))
    else:
        main()
