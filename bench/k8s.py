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
container costs plus the API calls (the pod, its secret, a watch of its start); on
a real cluster add its scheduler, the image pull and the kubelet's own start (seconds):
these figures are the scheduler's share.
Then, on Kubernetes only, per round:
  scale-up  one acquire of kind=anim gpu=entry on a cluster whose nodes have no GPU: the
        pod is Unschedulable until the emulated cluster autoscaler's L4 node arrives
        (TriggeredScaleUp; its delay of 180 s passed by moving the emulator's clock as
        soon as the event is recorded), then released and the node dropped. Its figure
        is the node's arrival (the clock's move answered) to the acquire's answer: what
        the scheduler adds to the cluster's own scale-up time.

    .venv/bin/python bench/k8s.py [--rounds 10]
"""

from __future__ import annotations

import contextlib
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _cold_warm import COMMON, main  # noqa: E402
from _common import WORKER_IMAGE, Service  # noqa: E402

from tests.k8s_emulator import KubeEmulator  # noqa: E402

KUBERNETES = "kubernetes (emulator)"
EMULATOR: list[KubeEmulator] = []  # the run's emulator, for the scale-up rounds
# The default node without its GPUs (the pool's pod stays on it), and an autoscaled pool
# of one-GPU L4 nodes, none yet, each brought 180 s after its scale-up.
CPU_NODE = {
    "name": "node-1",
    "labels": {"nvidia.com/gpu.product": "NVIDIA-L4"},
    "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"},
}
L4_POOL = {
    "name": "l4-pool",
    "template": {
        "labels": {"nvidia.com/gpu.product": "NVIDIA-L4"},
        "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": "1"},
    },
    "delaySeconds": 180,
}


@contextlib.contextmanager
def schedulers() -> Iterator[dict[str, Service]]:
    network = f"oa-bk8s-{uuid.uuid4().hex[:8]}"
    with KubeEmulator(network=network) as emulator:
        EMULATOR[:] = [emulator]
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
            yield {"docker": docker.start(), KUBERNETES: kube.start()}
        finally:
            docker.cleanup()
            kube.cleanup()


def scale_ups(services: dict[str, Service], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per round, a cold acquire that waits for the emulated autoscaler's new node: from
    the node's arrival to the answer."""
    [emulator], service = EMULATOR, services[KUBERNETES]
    emulator.set_nodes([CPU_NODE])
    emulator.set_node_groups([{**L4_POOL, "maxSize": rounds + 1}])
    took = []
    for _ in range(rounds + 1):  # the first warms the GPU class's path
        seen = len(_scale_ups(emulator))
        with ThreadPoolExecutor(1) as caller:
            acquired = caller.submit(_acquire, service)
            while len(_scale_ups(emulator)) == seen:
                time.sleep(0.01)
            emulator.advance_clock(180)
            arrived = time.perf_counter()
            answer, answered = acquired.result()
        if answer.status_code != 200:
            raise RuntimeError(f"scale-up acquire answered {answer.status_code}: {answer.text}")
        took.append(answered - arrived)
        lease_id = answer.json()["lease"]["lease_id"]
        service.http.delete(f"/v1/lease/{lease_id}")
        while any(
            p["metadata"]["labels"].get("openalice.io/lease") == lease_id
            for p in emulator.pods("openalice")
        ):
            time.sleep(0.05)
        emulator.set_nodes([CPU_NODE])  # the new node goes: the next round needs its own
    return {KUBERNETES: {"scale-up": took[1:]}}


def _acquire(service: Service) -> tuple[Any, float]:
    body = {"kind": "anim", "gpu": "entry", "ttl_seconds": 300}
    answer = service.http.post("/v1/lease", json=body)
    return answer, time.perf_counter()


def _scale_ups(emulator: KubeEmulator) -> list[dict[str, Any]]:
    return [e for e in emulator.events("openalice") if e["reason"] == "TriggeredScaleUp"]


if __name__ == "__main__":
    main(__doc__, schedulers, scale_ups)
