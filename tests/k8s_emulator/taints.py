"""Node taints and pod tolerations, by Kubernetes' rule
(https://kubernetes.io/docs/concepts/scheduling-eviction/taint-and-toleration/; the code:
k8s.io/api/core/v1 `Toleration.ToleratesTaint`, the scheduler's TaintToleration filter).

A toleration tolerates a taint when its effect is empty or the taint's, its key is empty
(with operator Exists: every taint) or the taint's, and with operator Equal (the
default) its value is the taint's, with Exists any value. The scheduler's filter looks at
the NoSchedule and NoExecute taints only (PreferNoSchedule merely scores a node lower,
which with the emulator's first-fit placement changes nothing) and names the first one
no toleration tolerates: `node(s) had untolerated taint {key: value}`.
"""

from __future__ import annotations

from typing import Any

EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def validate_taints(taints: list[Any]) -> list[dict[str, str]]:
    """A node's taints as the API holds them; ValueError on a bad one."""
    checked = []
    for taint in taints:
        if not isinstance(taint, dict) or not taint.get("key"):
            raise ValueError(f"a taint needs a key: {taint!r}")
        if taint.get("effect") not in EFFECTS:
            raise ValueError(f"a taint's effect is one of {', '.join(EFFECTS)}: {taint!r}")
        one = {"key": str(taint["key"]), "effect": str(taint["effect"])}
        if taint.get("value"):
            one["value"] = str(taint["value"])
        checked.append(one)
    return checked


def tolerates(toleration: dict[str, Any], taint: dict[str, str]) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint["effect"]:
        return False
    if toleration.get("key") and toleration["key"] != taint["key"]:
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return operator == "Equal" and (toleration.get("value") or "") == taint.get("value", "")


def untolerated(
    taints: list[dict[str, str]], tolerations: list[dict[str, Any]]
) -> dict[str, str] | None:
    """The first NoSchedule or NoExecute taint no toleration tolerates, or None."""
    for taint in taints:
        if taint["effect"] == "PreferNoSchedule":
            continue
        if not any(tolerates(t, taint) for t in tolerations):
            return taint
    return None
