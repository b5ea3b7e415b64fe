"""The scheduler's part: nodes, and where a pending pod fits.

A pod fits a node when the pod tolerates the node's NoSchedule and NoExecute taints
(taints.py), the node's labels include its `nodeSelector`, and every resource
it requests (`requests`, else `limits`: extended resources such as `nvidia.com/gpu` are
requested by their limit) is free there: the node's `allocatable` minus what the
non-terminated pods bound to it request; `pods` counts pods. When no node fits, the
reasons are written as the real scheduler's FitError does, one per node, from the first
filter it fails (TaintToleration, then NodeAffinity, then NodeResourcesFit, the default
profile's order):
`0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) didn't match Pod's
node affinity/selector.` (its "preemption: ..." tail is left out).
"""

from __future__ import annotations

import re
from collections import Counter
from decimal import Decimal
from typing import Any

from .taints import untolerated, validate_taints

DEFAULT_NODES: list[dict[str, Any]] = [
    {
        "name": "node-1",
        "labels": {"kubernetes.io/hostname": "node-1", "nvidia.com/gpu.product": "NVIDIA-L4"},
        "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": "2"},
    }
]
# A quantity's suffixes: the decimal SI ones (powers of 1000, and the fractions n, u, m)
# and the binary ones (powers of 1024),
# https://kubernetes.io/docs/reference/kubernetes-api/common-definitions/quantity/
_SUFFIXES = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    **{suffix: Decimal(1000**power) for power, suffix in enumerate("kMGTPE", 1)},
    **{suffix + "i": Decimal(1024**power) for power, suffix in enumerate("KMGTPE", 1)},
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")
SELECTOR_MISMATCH = "node(s) didn't match Pod's node affinity/selector"
TERMINATED = ("Succeeded", "Failed")


def quantity(value: Any) -> Decimal:
    """A Kubernetes quantity ("500m", "2Gi", "1", 2) as a number; ValueError if not one."""
    found = _QUANTITY.match(str(value).strip())
    if not found or found[2] not in _SUFFIXES:
        raise ValueError(f"quantities must match the regular expression {_QUANTITY.pattern}")
    return Decimal(found[1]) * _SUFFIXES[found[2]]


def requests_of(pod: dict[str, Any]) -> dict[str, Decimal]:
    total: dict[str, Decimal] = {}
    for container in pod["spec"].get("containers", []):
        resources = container.get("resources") or {}
        wanted = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for name, value in wanted.items():
            total[name] = total.get(name, Decimal(0)) + quantity(value)
    return total


def validate_nodes(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    checked = []
    for node in nodes:
        if not isinstance(node, dict) or not node.get("name"):
            raise ValueError(f"a node needs a name: {node!r}")
        allocatable = {str(k): str(v) for k, v in (node.get("allocatable") or {}).items()}
        for value in allocatable.values():
            quantity(value)
        labels = {"kubernetes.io/hostname": node["name"], **(node.get("labels") or {})}
        checked.append(
            {
                "name": str(node["name"]),
                "labels": labels,
                "allocatable": allocatable,
                "taints": validate_taints(node.get("taints") or []),
            }
        )
    return checked


def _reasons(pod: dict[str, Any], node: dict[str, Any], bound: list[dict[str, Any]]) -> list[str]:
    taint = untolerated(node.get("taints") or [], pod["spec"].get("tolerations") or [])
    if taint is not None:
        return [f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"]
    selector = pod["spec"].get("nodeSelector") or {}
    if any(node["labels"].get(k) != v for k, v in selector.items()):
        return [SELECTOR_MISMATCH]
    allocatable = {k: quantity(v) for k, v in node["allocatable"].items()}
    used: Counter[str] = Counter()
    for other in bound:
        for name, amount in requests_of(other).items():
            used[name] += amount  # type: ignore[assignment]
    reasons = []
    if len(bound) + 1 > allocatable.get("pods", Decimal(110)):
        reasons.append("Too many pods")
    for name, amount in sorted(requests_of(pod).items()):
        if amount > 0 and amount > allocatable.get(name, Decimal(0)) - used[name]:
            reasons.append(f"Insufficient {name}")
    return reasons


def place(
    pod: dict[str, Any], nodes: list[dict[str, Any]], pods: list[dict[str, Any]]
) -> tuple[str | None, str]:
    """(the node the pod goes to, "") or (None, the scheduler's message)."""
    if not nodes:
        return None, "no nodes available to schedule pods"
    counts: Counter[str] = Counter()
    for node in nodes:
        bound = [
            p
            for p in pods
            if p["spec"].get("nodeName") == node["name"]
            and p.get("status", {}).get("phase") not in TERMINATED
        ]
        reasons = _reasons(pod, node, bound)
        if not reasons:
            return node["name"], ""
        counts.update(reasons)
    histogram = sorted(f"{count} {reason}" for reason, count in counts.items())
    return None, f"0/{len(nodes)} nodes are available: {', '.join(histogram)}."
