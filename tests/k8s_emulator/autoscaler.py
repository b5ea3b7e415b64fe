"""The cluster autoscaler: node groups whose template node is added, after a delay on the
emulator's clock, when an unschedulable pod would fit it, and the events it records on
pods (https://github.com/kubernetes/autoscaler/blob/master/cluster-autoscaler/FAQ.md,
"How does scale-up work?" and "What events are emitted by CA?").

Each kubelet pass ends with a scan (the real one scans every 10 s, `--scan-interval`):
- a node whose delay has passed joins the cluster, named `<group>-<n>`, with the
  template's labels and allocatable;
- for each pod `PodScheduled=False`, reason `Unschedulable`, not yet helped: the first
  group whose template it would fit (the scheduler's own check, `scheduling.place`, on
  the template alone) and that is below its `maxSize` grows by one; the pod gets a Normal
  event `TriggeredScaleUp`, source `cluster-autoscaler`, `pod triggered scale-up:
  [{<group> <size>-><size + 1> (max: <maxSize>)}]`
  (cluster-autoscaler/processors/status/eventing_scale_up_processor.go);
- a pod no group can help gets `NotTriggerScaleUp`, `pod didn't trigger scale-up: ` and
  the reasons per group, counted ("1 node(s) didn't match Pod's node affinity/selector",
  "1 max node group size reached"), once per distinct message.

With no node group there is no autoscaler: no scan, no event (a cluster without one).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .scheduling import place, validate_nodes
from .store import Store

SOURCE = "cluster-autoscaler"
_AVAILABLE = re.compile(r"^0/\d+ nodes are available: (.*?)\.?$")


@dataclass
class NodeGroup:
    name: str
    template: dict[str, Any]  # a node, validated: labels, allocatable
    max_size: int
    delay_seconds: float
    size: int = 0  # nodes asked for so far (arrived or on their way)
    arrivals: list[float] = field(default_factory=list)  # on the emulator's clock
    added: int = 0  # nodes arrived so far


def validate_groups(groups: list[dict[str, Any]]) -> list[NodeGroup]:
    """`[{"name", "template": {"labels", "allocatable"}, "maxSize", "delaySeconds"}]` as
    node groups; ValueError naming what is wrong."""
    checked = []
    for group in groups:
        if not isinstance(group, dict) or not group.get("name"):
            raise ValueError(f"a node group needs a name: {group!r}")
        name = str(group["name"])
        template = dict(group.get("template") or {})
        [node] = validate_nodes([{**template, "name": f"{name}-template"}])
        max_size, delay = group.get("maxSize", 1), group.get("delaySeconds", 60)
        if not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"{name}: maxSize is a number >= 1")
        if not isinstance(delay, (int, float)) or delay < 0:
            raise ValueError(f"{name}: delaySeconds is a number >= 0")
        checked.append(NodeGroup(name, node, max_size, float(delay)))
    return checked


class Autoscaler:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.groups: list[NodeGroup] = []
        self._helped: set[str] = set()  # uids of pods a scale-up was triggered for
        self._refused: dict[str, str] = {}  # uid -> the last NotTriggerScaleUp message

    def reset(self) -> None:
        self.groups = []
        self._helped.clear()
        self._refused.clear()

    def scan(self, nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One scan: the nodes that arrive now (for the kubelet's node list), and the
        events on the unschedulable pods."""
        if not self.groups:
            return []
        arrived = self._arrivals()
        for pod in self.store.list("pods", None):
            if _unschedulable(pod) and pod["metadata"]["uid"] not in self._helped:
                self._consider(pod)
        return arrived

    def _arrivals(self) -> list[dict[str, Any]]:
        now, arrived = self.store.now(), []
        for group in self.groups:
            due = [t for t in group.arrivals if t <= now]
            group.arrivals = [t for t in group.arrivals if t > now]
            for _ in due:
                group.added += 1
                name = f"{group.name}-{group.added}"
                labels = {**group.template["labels"], "kubernetes.io/hostname": name}
                arrived.append({**group.template, "name": name, "labels": labels})
        return arrived

    def _consider(self, pod: dict[str, Any]) -> None:
        open_groups = [g for g in self.groups if g.size < g.max_size]
        for group in open_groups:
            node, _ = place(pod, [group.template], [])
            if node is not None:
                group.arrivals.append(self.store.now() + group.delay_seconds)
                info = f"{{{group.name} {group.size}->{group.size + 1} (max: {group.max_size})}}"
                group.size += 1
                self._helped.add(pod["metadata"]["uid"])
                self._event(pod, "TriggeredScaleUp", f"pod triggered scale-up: [{info}]")
                return
        reasons = []
        if open_groups:
            _, message = place(pod, [g.template for g in open_groups], [])
            found = _AVAILABLE.match(message)
            reasons.append(found[1] if found else message)
        if full := len(self.groups) - len(open_groups):
            reasons.append(f"{full} max node group size reached")
        message = f"pod didn't trigger scale-up: {', '.join(reasons)}"
        if self._refused.get(pod["metadata"]["uid"]) != message:
            self._refused[pod["metadata"]["uid"]] = message
            self._event(pod, "NotTriggerScaleUp", message)

    def _event(self, pod: dict[str, Any], reason: str, message: str) -> None:
        """A core/v1 Event on the pod, as the autoscaler's event recorder writes it."""
        meta, now = pod["metadata"], self.store.timestamp()
        self.store.add(
            "events",
            {
                "kind": "Event",
                "apiVersion": "v1",
                "metadata": {
                    "name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
                    "namespace": meta["namespace"],
                },
                "involvedObject": {
                    "kind": "Pod",
                    "namespace": meta["namespace"],
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "apiVersion": "v1",
                    "resourceVersion": meta["resourceVersion"],
                },
                "reason": reason,
                "message": message,
                "source": {"component": SOURCE},
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
                "type": "Normal",
                "eventTime": None,
                "reportingComponent": SOURCE,
                "reportingInstance": "",
            },
        )


def _unschedulable(pod: dict[str, Any]) -> bool:
    if pod["spec"].get("nodeName") or pod["metadata"].get("deletionTimestamp"):
        return False
    conditions = pod.get("status", {}).get("conditions") or []
    return any(
        c["type"] == "PodScheduled"
        and c["status"] == "False"
        and c.get("reason") == "Unschedulable"
        for c in conditions
    )
