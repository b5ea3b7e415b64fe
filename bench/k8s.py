#!/usr/bin/env python
"""Cold and warm acquire on Kubernetes (the emulator) beside Docker, in one run (issue 27).

Two schedulers, each with WARM_POOL=renderer/none=1 and readiness probed at /healthz:
one with PROVIDERS=local-docker, one with PROVIDERS=kubernetes against the Kubernetes
emulator (`tests/k8s_emulator/`: lightkube over the Kubernetes API through a kubeconfig,
each pod a Docker container of the demo worker started by the emulator's test kubelet).
Per round, on each in turn:
  cold  one acquire of kind=anim (no pool for anim: a container, or a pod and its
        secret, is made, waited for until Running and Ready, and probed), then released;
  warm  one acquire of kind=renderer served by the idle pool worker (the hand-off, at
        the pod's IP on Kubernetes), then released, and the pool refilled before the
        next round.
Latency is request sent to answer read. On the emulator a pod costs what its Docker
container costs plus the API calls and the provider's polling of the pod's status; on
a real cluster add its scheduler, the image pull and the kubelet's own start (seconds):
these figures are the scheduler's share.

    .venv/bin/python bench/k8s.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import WORKER_IMAGE, Service, summary  # noqa: E402

from tests.k8s_emulator import KubeEmulator  # noqa: E402

COMMON = {
    "WARM_POOL": "renderer/none=1",
    "RENDERER_READY_PATH": "/healthz",
    "ANIM_READY_PATH": "/healthz",
}


def idle(service: Service) -> int:
    answer = service.http.get("/v1/leases", params={"state": "idle"})
    return len(answer.json())


def timed(service: Service, kind: str) -> float:
    started = time.perf_counter()
    response = service.http.post("/v1/lease", json={"kind": kind, "ttl_seconds": 300})
    took = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{kind} acquire answered {response.status_code}: {response.text}")
    service.http.delete(f"/v1/lease/{response.json()['lease']['lease_id']}")
    return took


def wait_pool(service: Service, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while idle(service) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the pool did not refill")
        time.sleep(0.1)


@contextlib.contextmanager
def schedulers() -> Iterator[dict[str, Service]]:
    network = f"oa-bk8s-{uuid.uuid4().hex[:8]}"
    with KubeEmulator(network=network) as emulator:
        docker = Service("kdock", **COMMON)
        kube = Service(
            "k8s",
            PROVIDERS="kubernetes",
            KUBECONFIG=str(emulator.kubeconfig_path),
            K8S_RENDERER_IMAGE=WORKER_IMAGE,
            K8S_ANIM_IMAGE=WORKER_IMAGE,
            **COMMON,
        )
        try:
            yield {"docker": docker.start(), "kubernetes (emulator)": kube.start()}
        finally:
            docker.cleanup()
            kube.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    figures: dict[str, dict[str, list[float]]] = {}
    with schedulers() as services:
        for service in services.values():
            wait_pool(service)
            timed(service, "anim")  # the first of each: network and client made
        for _ in range(args.rounds):
            for name, service in services.items():
                got = figures.setdefault(name, {"cold": [], "warm": []})
                got["cold"].append(timed(service, "anim"))
                wait_pool(service)
                got["warm"].append(timed(service, "renderer"))
        for service in services.values():
            wait_pool(service)
    print(f"Acquire, request to answer, {args.rounds} rounds (2-core host)")
    for name, got in figures.items():
        for how in ("cold", "warm"):
            stats: dict[str, Any] = summary(got[how])
            print(
                f"  {name:22s} {how}: p50 {stats['p50'] * 1e3:7.1f} ms   "
                f"p99 {stats['p99'] * 1e3:7.1f} ms   max {stats['max'] * 1e3:7.1f} ms"
            )


if __name__ == "__main__":
    main()
