"""Label and field selectors, as `labelSelector=` / `fieldSelector=` of a list or watch.

Label selectors take the documented syntax: `k=v`, `k==v`, `k!=v`, `k in (a,b)`,
`k notin (a,b)`, `k` (exists) and `!k` (does not exist), joined by commas (AND). As in
Kubernetes, `k!=v` and `k notin (...)` also match objects without the label. Field
selectors take `=`, `==` and `!=` on the fields the API indexes for pods, secrets and
events.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .kstatus import ApiError

Matcher = Callable[[dict[str, Any]], bool]
_KEY = re.compile(r"^([a-z0-9A-Z][-a-z0-9A-Z_.]*/)?[a-z0-9A-Z]([-a-z0-9A-Z_.]*[a-z0-9A-Z])?$")
_SET = re.compile(r"^(\S+)\s+(in|notin)\s+\(([^)]*)\)$")
_FIELDS: dict[str, Callable[[dict[str, Any]], str]] = {
    "metadata.name": lambda o: str(o["metadata"].get("name", "")),
    "metadata.namespace": lambda o: str(o["metadata"].get("namespace", "")),
    "status.phase": lambda o: str(o.get("status", {}).get("phase", "")),
    "spec.nodeName": lambda o: str(o.get("spec", {}).get("nodeName", "")),
    "spec.restartPolicy": lambda o: str(o.get("spec", {}).get("restartPolicy", "")),
    "type": lambda o: str(o.get("type", "")),
    # Events' fields (the core/v1 Event field selectors,
    # https://kubernetes.io/docs/concepts/overview/working-with-objects/field-selectors/;
    # `kubectl get events --field-selector involvedObject.name=x`).
    **{
        f"involvedObject.{key}": lambda o, k=key: str((o.get("involvedObject") or {}).get(k, ""))
        for key in ("kind", "namespace", "name", "uid", "apiVersion")
    },
    "reason": lambda o: str(o.get("reason", "")),
    "source": lambda o: str((o.get("source") or {}).get("component", "")),
}


def _split(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _bad(text: str, why: str) -> ApiError:
    return ApiError(400, f"unable to parse requirement: {why}: {text!r}")


def _key(key: str, text: str) -> str:
    if not _KEY.match(key) or len(key.split("/")[-1]) > 63:
        raise _bad(text, f"invalid label key {key!r}")
    return key


def _requirement(text: str) -> Callable[[dict[str, str]], bool]:
    found = _SET.match(text)
    if found:
        key, op, values = (
            _key(found[1], text),
            found[2],
            {v.strip() for v in found[3].split(",") if v.strip()},
        )
        if not values:
            raise _bad(text, "for 'in', 'notin' operators, values set can't be empty")
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    for op in ("!=", "==", "="):
        if op in text:
            key, value = (s.strip() for s in text.split(op, 1))
            _key(key, text)
            if op == "!=":
                return lambda labels: labels.get(key) != value
            return lambda labels: labels.get(key) == value
    if text.startswith("!"):
        key = _key(text[1:].strip(), text)
        return lambda labels: key not in labels
    key = _key(text, text)
    return lambda labels: key in labels


def label_matcher(selector: str | None) -> Matcher:
    if not selector:
        return lambda _obj: True
    requirements = [_requirement(part) for part in _split(selector)]

    def match(obj: dict[str, Any]) -> bool:
        labels = obj["metadata"].get("labels") or {}
        return all(r(labels) for r in requirements)

    return match


def field_matcher(selector: str | None) -> Matcher:
    if not selector:
        return lambda _obj: True
    checks: list[Callable[[dict[str, Any]], bool]] = []
    for part in _split(selector):
        for op in ("!=", "==", "="):
            if op in part:
                name, value = (s.strip() for s in part.split(op, 1))
                break
        else:
            raise ApiError(400, f"invalid selector: '{selector}'; can't understand '{part}'")
        getter = _FIELDS.get(name)
        if getter is None:
            raise ApiError(400, f"field label not supported: {name}")
        if op == "!=":
            checks.append(lambda o, g=getter, v=value: g(o) != v)
        else:
            checks.append(lambda o, g=getter, v=value: g(o) == v)
    return lambda obj: all(c(obj) for c in checks)
