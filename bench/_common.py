"""Shared helpers for the benchmarks: run the real service as a subprocess on a free
loopback port with its own SQLite file, instance name and Docker network, and clean up
everything it (and the baseline) created. Not a test harness: nothing here asserts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from openalice_scheduler.client.core import LIMITS

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
WORKER_IMAGE = "openalice-demo-worker:latest"
INSTANCE_LABEL = "openalice.scheduler.instance"
DOCKER_SOCKET = "unix:///var/run/docker.sock"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(p / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "min": min(values),
        "p50": statistics.median(values),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values),
    }


def worker_timing(response: httpx.Response) -> tuple[str, float | None]:
    """How an acquire's worker came ("warm", "cold"; "?" when not said) and the seconds
    the request waited on it (None: not said), from its `Server-Timing:
    worker;desc=...;dur=<ms>`."""
    how: str = "?"
    waited: float | None = None
    for metric in response.headers.get("server-timing", "").split(","):
        name, *params = metric.strip().split(";")
        if name != "worker":
            continue
        for param in params:
            if param.startswith("desc="):
                how = param[5:].strip('"')
            elif param.startswith("dur="):
                waited = float(param[4:]) / 1000
    return how, waited


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time the processes (all their threads) used so far, from
    /proc/<pid>/stat; a process that has ended counts nothing."""
    ticks = os.sysconf("SC_CLK_TCK")
    used = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        used += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return used


def process_tree(pid: int) -> list[int]:
    """`pid` and the processes it started, theirs too (the scheduler's SQLite sync
    helper), from /proc."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            todo += map(int, Path(f"/proc/{current}/task/{current}/children").read_text().split())
    return found


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in KiB, from /proc."""
    found: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0])
    return found


class HttpConnection:
    """One kept-alive HTTP/1.1 connection, spoken by hand over asyncio streams: the load
    generators' client. It shares the 2 cores with the server it measures, and httpx
    spends several times more CPU per request (~20 ms per round trip at 32 concurrent
    clients against ~2 ms here), so with httpx the client, not the server, set the pace."""

    def __init__(self, port: int, headers: dict[str, str] | None = None) -> None:
        self.port = port
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{self.headers}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        reused = self.writer is not None
        try:
            raw = await self._send(head)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            # The server closes idle kept-alive connections (uvicorn: after 5 s); a closed
            # one answers nothing at all, and the request was not seen: send it anew.
            if not reused or (isinstance(exc, asyncio.IncompleteReadError) and exc.partial):
                raise
            await self.close()
            raw = await self._send(head)
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        assert self.reader is not None
        return status, await self.reader.readexactly(length) if length else b""

    async def _send(self, head: bytes) -> bytes:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        self.writer.write(head)
        return await self.reader.readuntil(b"\r\n\r\n")

    async def close(self) -> None:
        writer, self.reader, self.writer = self.writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


LEASE_BODY = b'{"kind": "renderer", "ttl_seconds": 600}'


async def lease_round(http: HttpConnection) -> bool:
    """One acquire + release through the scheduler; True when both succeeded."""
    status, body = await http.request("POST", "/v1/lease", LEASE_BODY)
    if status != 200:
        return False
    lease_id = json.loads(body)["lease"]["lease_id"]
    return (await http.request("DELETE", f"/v1/lease/{lease_id}"))[0] == 204


async def drive(
    port: int,
    headers: dict[str, str],
    clients: int,
    seconds: float,
    round_trip: Callable[[HttpConnection], Awaitable[bool]],
) -> tuple[list[float], int, float]:
    """`clients` connections, each running `round_trip` back to back for `seconds`.
    Returns the durations of the round trips that succeeded, the number that failed, and
    the wall time."""
    conns = [HttpConnection(port, headers) for _ in range(clients)]
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds

    async def client(http: HttpConnection) -> None:
        nonlocal errors
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            if await round_trip(http):
                latencies.append(time.perf_counter() - started)
            else:
                errors += 1

    started = time.perf_counter()
    try:
        await asyncio.gather(*(client(http) for http in conns))
    finally:
        elapsed = time.perf_counter() - started
        for http in conns:
            await http.close()
    return latencies, errors, elapsed


async def in_process_rate(
    one_round: Callable[[], Awaitable[None]],
    clients: int,
    seconds: float,
) -> tuple[float, float]:
    """`clients` callers in this process, each running `one_round` back to back for
    `seconds` (after one second of warm-up with 3): (round trips per second, CPU ms of
    this process per round trip)."""
    rounds = 0

    async def caller(until: float) -> None:
        nonlocal rounds
        while time.monotonic() < until:
            await one_round()
            rounds += 1

    await asyncio.gather(*(caller(time.monotonic() + 1) for _ in range(3)))
    rounds = 0
    cpu, started = time.process_time(), time.monotonic()
    await asyncio.gather(*(caller(started + seconds) for _ in range(clients)))
    cpu, elapsed = time.process_time() - cpu, time.monotonic() - started
    return rounds / elapsed, cpu * 1000 / max(1, rounds)


class Service:
    """One scheduler process, started as `python -m openalice_scheduler serve`."""

    def __init__(self, prefix: str, **env: str) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"oa-bench-{prefix}-"))
        self.instance = f"b{prefix[:6]}-{uuid.uuid4().hex[:10]}"
        self.network = f"oa-{self.instance}"
        self.db_path = self.workdir / "bench.db"
        self.port = free_port()
        self.secret = "bench-" + uuid.uuid4().hex
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.workdir / "scheduler.log"
        self.env = {
            "INTERNAL_SECRET": self.secret,
            "SCHEDULER_HOST": "127.0.0.1",
            "SCHEDULER_PORT": str(self.port),
            "SCHEDULER_INSTANCE": self.instance,
            "DATABASE_URL": f"sqlite:///{self.db_path}",
            "DOCKER_NETWORK": self.network,
            "RENDERER_IMAGE": WORKER_IMAGE,
            "ANIM_IMAGE": WORKER_IMAGE,
            "LOCAL_GPU_DEVICES": "",
            "RUST_LOG": "warn",
            "PYTHONUNBUFFERED": "1",
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(
            base_url=self.url,
            headers={"X-Internal-Secret": self.secret},
            timeout=120,
            limits=LIMITS,
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 60) -> Service:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("OTEL_", "RUST_LOG", "LOG_LEVEL"))
        }
        env.update(self.env)
        src = str(REPO / "src")
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [PYTHON, "-m", "openalice_scheduler", "serve"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"scheduler exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"scheduler not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        self.http.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def cleanup(self, keep_workdir: bool = False) -> None:
        """Stop the process, remove every container labelled with this instance and the
        network, and the temp directory."""
        self.stop()
        remove_instance(self.instance, self.network)
        if not keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.cleanup()


def docker_client() -> Any:
    import docker

    return docker.DockerClient(base_url=DOCKER_SOCKET, version="1.41", timeout=120)


def remove_instance(instance: str, network: str | None) -> None:
    import docker

    client = docker_client()
    try:
        for container in client.containers.list(
            all=True, filters={"label": f"{INSTANCE_LABEL}={instance}"}
        ):
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)
        if network:
            for net in client.networks.list(names=[network]):
                if net.name == network:
                    with contextlib.suppress(docker.errors.APIError):
                        net.remove()
    finally:
        client.close()


def lease_rows(count: int, provider: str = "local-docker") -> list[dict[str, Any]]:
    """`count` active leases shaped like the ones the service writes (uuid4 ids, the
    container-name endpoint, a 64-hex container id, some with owner and correlation id),
    created just now, expiring 8 h later."""
    from openalice_scheduler.lifecycle import utcnow
    from openalice_scheduler.store import to_us

    now = to_us(utcnow())
    ttl = 28_800
    rows = []
    for i in range(count):
        lease_id = str(uuid.uuid4())
        kind = "renderer" if i % 2 == 0 else "anim"
        created = now - (count - i) * 1_000
        rows.append(
            {
                "lease_id": lease_id,
                "provider": provider,
                "kind": kind,
                "gpu": "none",
                "state": "active",
                "endpoint": f"http://oa-{kind}-{uuid.UUID(lease_id).hex[:12]}:8080",
                "provider_token": uuid.uuid4().hex + uuid.uuid4().hex,
                "owner_id": f"owner-{i % 97}" if i % 3 == 0 else None,
                "correlation_id": f"corr-{uuid.uuid4().hex[:16]}" if i % 2 == 0 else None,
                "region": None,
                "resource": None,
                "ttl_seconds": ttl,
                "created_at": created,
                "expires_at": created + ttl * 1_000_000,
                "released_at": None,
                "release_reason": None,
                "release_attempts": 0,
                "next_attempt_at": None,
                "last_error": None,
                "updated_at": created,
            }
        )
    return rows


class Seeder:
    """Writes lease rows straight into a running service's SQLite file (WAL: the
    service keeps serving; its `.lock` only keeps out a second scheduler)."""

    def __init__(self, db_path: Path) -> None:
        import sqlalchemy

        self.engine = sqlalchemy.create_engine(f"sqlite:///{db_path}", connect_args={"timeout": 30})

    def insert(self, rows: list[dict[str, Any]]) -> None:
        from openalice_scheduler.store.schema import leases

        with self.engine.begin() as conn:
            conn.execute(leases.insert(), rows)

    def close(self) -> None:
        self.engine.dispose()


def seed_active_leases(db_path: Path, count: int, provider: str = "local-docker") -> None:
    """Insert `count` active leases (lease_rows) in one transaction."""
    seeder = Seeder(db_path)
    try:
        seeder.insert(lease_rows(count, provider))
    finally:
        seeder.close()


async def reference_body(db_path: Path) -> bytes:
    """GET /v1/leases rendered the plain way: every active row read with sqlite3 (the
    running service holds the store), loaded as a LeaseRecord, .wire(), then
    starlette's JSONResponse encoding."""
    import json
    import sqlite3

    from openalice_scheduler.store import LeaseRecord

    with contextlib.closing(sqlite3.connect(db_path)) as conn:
        rows = conn.execute(
            "SELECT * FROM leases WHERE state = 'active' ORDER BY created_at"
        ).fetchall()
    wire = [LeaseRecord(*row).wire() for row in rows]
    return json.dumps(
        wire, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode()


def ensure_src_on_path() -> None:
    src = str(REPO / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
