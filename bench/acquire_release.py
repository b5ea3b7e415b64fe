#!/usr/bin/env python
"""Acquire + release of one worker through the service, against doing the same by hand.

Per round, in turn (the order rotates each round so none always runs first):
  service  POST /v1/lease {"kind": "renderer"} -> 200, then DELETE /v1/lease/{id} -> 204
           (httpx, keep-alive connection, over loopback)
  cli      `docker run -d` + `docker rm -f` of the same image, on the same network, with the
           same name pattern, labels, hostname and environment (docker CLI via subprocess)
  sdk      docker SDK containers.run(detach=True) + container.remove(force=True), same args

Goal: median(service) / median(cli) <= 1.10.

    .venv/bin/python bench/acquire_release.py [--n 30] [--warmup 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import INSTANCE_LABEL, WORKER_IMAGE, Service, docker_client, summary  # noqa: E402

ROUND_TIMEOUT_S = 120.0
GOAL_RATIO = 1.10


def worker_args(instance: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """Name, labels and environment like the service gives a renderer worker."""
    lease_id = str(uuid.uuid4())
    name = f"oa-renderer-{uuid.UUID(lease_id).hex[:12]}"
    labels = {
        "openalice.scheduler.lease_id": lease_id,
        "openalice.scheduler.kind": "renderer",
        INSTANCE_LABEL: instance,
    }
    expires = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    env = {"LEASE_ID": lease_id, "LEASE_EXPIRES_AT": expires, "WORKER_KIND": "renderer"}
    return name, labels, env


def run_service(svc: Service) -> tuple[float, float]:
    t0 = time.perf_counter()
    r = svc.http.post("/v1/lease", json={"kind": "renderer"})
    t1 = time.perf_counter()
    if r.status_code != 200:
        raise RuntimeError(f"acquire: {r.status_code} {r.text}")
    lease_id = r.json()["lease"]["lease_id"]
    t2 = time.perf_counter()
    d = svc.http.delete(f"/v1/lease/{lease_id}")
    t3 = time.perf_counter()
    if d.status_code != 204:
        raise RuntimeError(f"release: {d.status_code} {d.text}")
    return t1 - t0, t3 - t2


def run_cli(instance: str, network: str) -> tuple[float, float]:
    name, labels, env = worker_args(instance)
    cmd = ["docker", "run", "-d", "--name", name, "--hostname", name, "--network", network]
    for k, v in labels.items():
        cmd += ["--label", f"{k}={v}"]
    for k, v in env.items():
        cmd += ["--env", f"{k}={v}"]
    cmd.append(WORKER_IMAGE)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=ROUND_TIMEOUT_S)
    t1 = time.perf_counter()
    if out.returncode != 0:
        raise RuntimeError(f"docker run: {out.stderr.strip()}")
    cid = out.stdout.strip()
    t2 = time.perf_counter()
    rm = subprocess.run(
        ["docker", "rm", "-f", cid], capture_output=True, text=True, timeout=ROUND_TIMEOUT_S
    )
    t3 = time.perf_counter()
    if rm.returncode != 0:
        raise RuntimeError(f"docker rm: {rm.stderr.strip()}")
    return t1 - t0, t3 - t2


def run_sdk(client, instance: str, network: str) -> tuple[float, float]:  # noqa: ANN001
    name, labels, env = worker_args(instance)
    t0 = time.perf_counter()
    container = client.containers.run(
        WORKER_IMAGE,
        name=name,
        hostname=name,
        labels=labels,
        environment=env,
        network=network,
        detach=True,
    )
    t1 = time.perf_counter()
    t2 = time.perf_counter()
    container.remove(force=True)
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2


def ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30, help="measured rounds (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured rounds first")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=900,
        help="stop early (with what was measured) after this long",
    )
    args = parser.parse_args()
    if not 1 <= args.n <= 1000:
        parser.error("--n must be 1..1000")

    svc = Service("acq", SWEEP_INTERVAL_SECONDS="3600", RECONCILE_INTERVAL_SECONDS="86400")
    client = docker_client()
    started = time.monotonic()
    kinds = ("service", "cli", "sdk")
    total = {k: [] for k in kinds}
    acquire = {k: [] for k in kinds}
    release = {k: [] for k in kinds}
    try:
        svc.start()
        # The first acquire creates DOCKER_NETWORK (as a deployment would, once); it is
        # then shared by the baselines.
        for i in range(args.warmup + args.n):
            if time.monotonic() - started > args.max_seconds:
                print(f"stopped after {i} rounds: --max-seconds reached", file=sys.stderr)
                break
            order = kinds[i % 3 :] + kinds[: i % 3]
            for kind in order:
                if kind == "service":
                    a, r = run_service(svc)
                elif kind == "cli":
                    a, r = run_cli(svc.instance, svc.network)
                else:
                    a, r = run_sdk(client, svc.instance, svc.network)
                if i >= args.warmup:
                    acquire[kind].append(a)
                    release[kind].append(r)
                    total[kind].append(a + r)
    finally:
        client.close()
        svc.cleanup()

    if not total["service"]:
        print("nothing measured", file=sys.stderr)
        return 1
    print(
        f"acquire+release of one worker, {len(total['service'])} rounds "
        f"(+{args.warmup} warm-up), image {WORKER_IMAGE}, alternated; times in ms"
    )
    print(f"{'':30} {'p50':>8} {'p90':>8} {'min':>8} {'max':>8}")
    labels = {
        "service": "service (HTTP)",
        "cli": "docker CLI run -d / rm -f",
        "sdk": "docker SDK run / remove",
    }
    for kind in kinds:
        for what, data in (("total", total), ("  acquire", acquire), ("  release", release)):
            s = summary(data[kind])
            name = labels[kind] if what == "total" else what
            print(f"{name:30} {ms(s['p50'])} {ms(s['p90'])} {ms(s['min'])} {ms(s['max'])}")
    svc50, cli50, sdk50 = (summary(total[k])["p50"] for k in kinds)
    svc90, cli90, sdk90 = (summary(total[k])["p90"] for k in kinds)
    ratio = svc50 / cli50
    print(
        f"ratio service/cli  p50 {ratio:.3f}  p90 {svc90 / cli90:.3f}   "
        f"(goal p50 <= {GOAL_RATIO:.2f}: {'met' if ratio <= GOAL_RATIO else 'MISSED'})"
    )
    print(f"ratio service/sdk  p50 {svc50 / sdk50:.3f}  p90 {svc90 / sdk90:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
