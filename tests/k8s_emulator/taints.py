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


def toleration_causes(spec: dict[str, Any]) -> list[tuple[str, str, str]]:
    """What the API server's validation (ValidateTolerations, pkg/apis/core/validation)
    refuses in a pod's tolerations, as 422 causes (field, type, message)."""
    causes = []
    for index, toleration in enumerate(spec.get("tolerations") or []):
        path = f"spec.tolerations[{index}]"
        key, operator = toleration.get("key") or "", toleration.get("operator") or ""
        value, effect = toleration.get("value") or "", toleration.get("effect") or ""
        if not key and operator != "Exists":
            causes.append(
                (
                    f"{path}.operator",
                    "FieldValueInvalid",
                    f'Invalid value: "{operator}": operator must be Exists when `key` is '
                    'empty, which means "match all values and all keys"',
                )
            )
        if toleration.get("tolerationSeconds") is not None and effect != "NoExecute":
            causes.append(
                (
                    f"{path}.effect",
                    "FieldValueInvalid",
                    f"Invalid value: \"{effect}\": effect must be 'NoExecute' when "
                    "`tolerationSeconds` is set",
                )
            )
        if operator == "Exists" and value:
            causes.append(
                (
                    f"{path}.operator",
                    "FieldValueInvalid",
                    "Invalid value: value must be empty when `operator` is 'Exists'",
                )
            )
        elif operator not in ("", "Equal", "Exists"):
            causes.append(
                (
                    f"{path}.operator",
                    "FieldValueNotSupported",
                    f'Unsupported value: "{operator}": supported values: "Equal", "Exists"',
                )
            )
        if effect and effect not in EFFECTS:
            causes.append(
                (
                    f"{path}.effect",
                    "FieldValueNotSupported",
                    f'Unsupported value: "{effect}": supported values: "NoSchedule", '
                    '"PreferNoSchedule", "NoExecute"',
                )
            )
    return causes
