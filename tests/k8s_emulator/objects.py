"""What the API server does to a Pod or Secret body: decode it against the contract,
validate it (422 Invalid, in the real API's words), fill the defaults, and apply an
update or a patch under the rules of pod updates."""

from __future__ import annotations

import base64
import binascii
import copy
import re
import secrets
from typing import Any

from . import contract
from .kstatus import ApiError, invalid
from .scheduling import quantity
from .taints import toleration_causes

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN_MESSAGE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
    "'-' or '.', and must start and end with an alphanumeric character (e.g. "
    "'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
POD_UPDATE_FORBIDDEN = (
    "Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
    "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` "
    "(only additions to existing tolerations),`spec.terminationGracePeriodSeconds` "
    "(allow it to be set to 1 if it was previously negative)"
)
MUTABLE_METADATA = ("labels", "annotations", "ownerReferences", "finalizers")
KINDS = {"pods": "Pod", "secrets": "Secret"}


def decode(kind: str, body: Any, field_validation: str | None) -> tuple[list[str], list[str]]:
    """Strict unless `fieldValidation=Warn|Ignore`; (warnings, missing required fields)."""
    mode = (field_validation or "Strict").lower()
    if mode not in ("strict", "warn", "ignore"):
        raise ApiError(
            400,
            f'fieldValidation must be one of "Ignore", "Warn", or "Strict"; got "{field_validation}"',  # noqa: E501 - the API's own wording
        )
    try:
        unknown, missing = contract.check(kind, body, strict=mode == "strict")
    except contract.DecodeError as exc:
        raise ApiError(400, str(exc)) from exc
    if body.get("kind") not in (None, kind) or body.get("apiVersion") not in (None, "v1"):
        raise ApiError(
            400,
            f"the API version in the data ({body.get('apiVersion')}) does not match the "
            f"expected API version (v1)"
            if body.get("kind") in (None, kind)
            else f'{kind} in version "v1" cannot be handled as a {kind}: no kind '
            f'"{body.get("kind")}" is registered for version "v1"',
        )
    warnings = [f'unknown field "{name}"' for name in unknown] if mode == "warn" else []
    return warnings, missing


def _metadata(kind: str, body: dict[str, Any], namespace: str) -> list[tuple[str, str, str]]:
    meta = body.setdefault("metadata", {})
    if meta.get("namespace") not in (None, "", namespace):
        raise ApiError(
            400,
            "the namespace of the provided object does not match the namespace sent on the request",
        )
    meta["namespace"] = namespace
    if not meta.get("name") and meta.get("generateName"):
        meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
    for key in (
        "uid",
        "resourceVersion",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "generation",
    ):
        meta.pop(key, None)
    name = meta.get("name") or ""
    causes = []
    if not name:
        causes.append(
            (
                "metadata.name",
                "FieldValueRequired",
                "Required value: name or generateName is required",
            )
        )
    elif len(name) > 253 or not _SUBDOMAIN.match(name):
        causes.append(
            ("metadata.name", "FieldValueInvalid", f'Invalid value: "{name}": {_SUBDOMAIN_MESSAGE}')
        )
    for owner in meta.get("ownerReferences") or []:
        for field in ("apiVersion", "kind", "name", "uid"):
            if not owner.get(field):
                causes.append(
                    (
                        f"metadata.ownerReferences.{field}",
                        "FieldValueRequired" if field != "uid" else "FieldValueInvalid",
                        "Required value"
                        if field != "uid"
                        else 'Invalid value: "": uid must not be empty',
                    )
                )
    return causes


def new_pod(body: dict[str, Any], namespace: str) -> dict[str, Any]:
    """Validate and default a Pod to create (422 on what the API refuses)."""
    causes = _metadata("Pod", body, namespace)
    spec = body.get("spec") or {}
    containers = spec.get("containers") or []
    if not containers:
        causes.append(("spec.containers", "FieldValueRequired", "Required value"))
    if len(containers) > 1:
        causes.append(
            (
                "spec.containers",
                "FieldValueNotSupported",
                "Unsupported value: the emulator's kubelet runs one container per pod",
            )
        )
    for index, container in enumerate(containers):
        path = f"spec.containers[{index}]"
        if not container.get("name"):
            causes.append((f"{path}.name", "FieldValueRequired", "Required value"))
        elif not _LABEL.match(container["name"]):
            causes.append(
                (
                    f"{path}.name",
                    "FieldValueInvalid",
                    f"Invalid value: \"{container['name']}\": a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-'",  # noqa: E501 - the API's own wording
                )
            )
        if not container.get("image"):
            causes.append((f"{path}.image", "FieldValueRequired", "Required value"))
        for part in ("limits", "requests"):
            for resource, value in ((container.get("resources") or {}).get(part) or {}).items():
                try:
                    quantity(value)
                except ValueError as exc:
                    causes.append(
                        (
                            f"{path}.resources.{part}[{resource}]",
                            "FieldValueInvalid",
                            f'Invalid value: "{value}": {exc}',
                        )
                    )
    causes += toleration_causes(spec)
    if spec.get("restartPolicy") not in (None, "Always", "OnFailure", "Never"):
        causes.append(
            (
                "spec.restartPolicy",
                "FieldValueNotSupported",
                f'Unsupported value: "{spec["restartPolicy"]}": supported values: "Always", "OnFailure", "Never"',  # noqa: E501 - the API's own wording
            )
        )
    deadline = spec.get("activeDeadlineSeconds")
    if deadline is not None and not 1 <= deadline <= 2**31 - 1:
        causes.append(
            (
                "spec.activeDeadlineSeconds",
                "FieldValueInvalid",
                f"Invalid value: {deadline}: must be between 1 and 2147483647, inclusive",
            )
        )
    if spec.get("terminationGracePeriodSeconds", 0) < 0:
        causes.append(
            (
                "spec.terminationGracePeriodSeconds",
                "FieldValueInvalid",
                f"Invalid value: {spec['terminationGracePeriodSeconds']}: must be greater than or equal to 0",  # noqa: E501 - the API's own wording
            )
        )
    if causes:
        raise invalid("Pod", body["metadata"].get("name") or "", causes)
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("serviceAccountName", "default")
    spec.setdefault("securityContext", {})
    spec.setdefault("enableServiceLinks", True)
    for container in containers:
        latest = ":" not in container["image"].split("/")[-1] or container["image"].endswith(
            ":latest"
        )
        container.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
        container.setdefault("terminationMessagePath", "/dev/termination-log")
        container.setdefault("terminationMessagePolicy", "File")
        container.setdefault("resources", {})
    body["spec"] = spec
    body["apiVersion"], body["kind"] = "v1", "Pod"
    body["status"] = {"phase": "Pending", "qosClass": _qos(containers)}
    return body


def _qos(containers: list[dict[str, Any]]) -> str:
    limits = [(c.get("resources") or {}).get("limits") or {} for c in containers]
    requests = [(c.get("resources") or {}).get("requests") or {} for c in containers]
    if not any(limits) and not any(requests):
        return "BestEffort"
    guaranteed = all(
        {"cpu", "memory"} <= set(lim) and all(req.get(k, lim[k]) == lim[k] for k in lim)
        for lim, req in zip(limits, requests, strict=True)
    )
    return "Guaranteed" if guaranteed else "Burstable"


def new_secret(body: dict[str, Any], namespace: str) -> dict[str, Any]:
    causes = _metadata("Secret", body, namespace)
    data = dict(body.get("data") or {})
    for key, value in data.items():
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(
                400,
                f'Secret in version "v1" cannot be handled as a Secret: illegal base64 data at input byte 0 (data["{key}"])',  # noqa: E501 - the API's own wording
            ) from None
    for key, value in (body.pop("stringData", None) or {}).items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    for key in data:
        if not re.match(r"^[-._a-zA-Z0-9]+$", key):
            causes.append(
                (
                    f"data[{key}]",
                    "FieldValueInvalid",
                    f"Invalid value: \"{key}\": a valid config key must consist of alphanumeric characters, '-', '_' or '.'",  # noqa: E501 - the API's own wording
                )
            )
    if causes:
        raise invalid("Secret", body["metadata"].get("name") or "", causes)
    body["data"] = data
    body.setdefault("type", "Opaque")
    body["apiVersion"], body["kind"] = "v1", "Secret"
    return body


# --- updates and patches -------------------------------------------------------------


def merge_patch(target: Any, patch: Any, strategic: bool = False) -> Any:
    """RFC 7386 merge patch; `strategic`: lists of named objects merge by `name`."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue  # strategic-merge directives ($patch, $retainKeys): not emulated
        if value is None:
            result.pop(key, None)
        elif (
            strategic
            and isinstance(value, list)
            and isinstance(result.get(key), list)
            and all(isinstance(v, dict) and "name" in v for v in value + result[key])
        ):
            merged = {item["name"]: item for item in copy.deepcopy(result[key])}
            for item in value:
                merged[item["name"]] = merge_patch(merged.get(item["name"], {}), item, True)
            result[key] = list(merged.values())
        else:
            result[key] = merge_patch(result.get(key), value, strategic)
    return result


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 (add, remove, replace, test)."""
    if not isinstance(operations, list):
        raise ApiError(400, "the server rejected our request due to an error in our request")
    document = copy.deepcopy(target)
    for op in operations:
        parts = [
            p.replace("~1", "/").replace("~0", "~") for p in str(op.get("path", "")).split("/")[1:]
        ]
        parent = document
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent.get(part)
            if parent is None:
                raise ApiError(
                    422,
                    f'jsonpatch {op.get("op")} operation does not apply: doc is missing path: "{op.get("path")}"',  # noqa: E501 - the API's own wording
                    reason="Invalid",
                )
        last = parts[-1] if parts else ""
        kind = op.get("op")
        if kind in ("add", "replace"):
            if isinstance(parent, list):
                index = len(parent) if last == "-" else int(last)
                parent.insert(index, op.get("value")) if kind == "add" else parent.__setitem__(
                    index, op.get("value")
                )
            else:
                parent[last] = op.get("value")
        elif kind == "remove":
            if isinstance(parent, list):
                parent.pop(int(last))
            elif last in parent:
                del parent[last]
            else:
                raise ApiError(
                    422,
                    f"jsonpatch remove operation does not apply: doc is missing key: {op.get('path')}",  # noqa: E501 - the API's own wording
                    reason="Invalid",
                )
        elif kind == "test":
            value = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if value != op.get("value"):
                raise ApiError(
                    422, f"testing value {op.get('path')} failed: test failed", reason="Invalid"
                )
        else:
            raise ApiError(400, f"Unexpected kind: {kind}")
    return document


def updated(resource: str, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The object after an update from `new`, under the API's rules (422 if refused):
    metadata keeps its server fields; a pod's spec may change only its
    activeDeadlineSeconds (set when unset, or lowered); status is the server's."""
    result = copy.deepcopy(old)
    meta = new.get("metadata") or {}
    for key in MUTABLE_METADATA:
        if meta.get(key) is not None:
            result["metadata"][key] = meta[key]
        else:
            result["metadata"].pop(key, None)
    name = old["metadata"]["name"]
    if resource == "secrets":
        if old.get("immutable") and (new.get("data") != old.get("data") or new.get("stringData")):
            raise invalid(
                "Secret",
                name,
                [
                    (
                        "data",
                        "FieldValueForbidden",
                        "Forbidden: field is immutable when `immutable` is set",
                    )
                ],
            )
        data = dict(new.get("data") or {})
        for key, value in (new.get("stringData") or {}).items():
            data[key] = base64.b64encode(str(value).encode()).decode()
        result["data"] = data
        result["immutable"] = new.get("immutable", old.get("immutable"))
        if result["immutable"] is None:
            result.pop("immutable")
        return result
    old_spec, new_spec = dict(old["spec"]), dict(new.get("spec") or {})
    old_deadline = old_spec.pop("activeDeadlineSeconds", None)
    new_deadline = new_spec.pop("activeDeadlineSeconds", None)

    def deadline_invalid(why: str) -> ApiError:
        return invalid("Pod", name, [("spec.activeDeadlineSeconds", "FieldValueInvalid", why)])

    if new_deadline is not None:
        if not 0 <= new_deadline <= 2**31 - 1:
            raise deadline_invalid(  # the API's own wording, as below
                f"Invalid value: {new_deadline}: must be between 0 and 2147483647, inclusive"
            )
        if old_deadline is not None and old_deadline < new_deadline:
            raise deadline_invalid(
                f"Invalid value: {new_deadline}: must be less than or equal to previous value"
            )
    elif old_deadline is not None:
        raise deadline_invalid(
            'Invalid value: "null": must not update from a positive integer to nil value'
        )
    if old_spec != new_spec:
        changed = sorted(
            k for k in set(old_spec) | set(new_spec) if old_spec.get(k) != new_spec.get(k)
        )
        raise invalid(
            "Pod",
            name,
            [
                (
                    "spec",
                    "FieldValueForbidden",
                    POD_UPDATE_FORBIDDEN
                    + "\n  core.PodSpec{ changed: "
                    + ", ".join(changed)
                    + " }",
                )
            ],
        )
    if new_deadline is not None:
        result["spec"]["activeDeadlineSeconds"] = new_deadline
    return result
