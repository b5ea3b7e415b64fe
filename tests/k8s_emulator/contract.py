"""Request bodies checked against `contract.json` (see make_contract.py), as the real API
server decodes them with strict field validation: every unknown field is named
(`strict decoding error: unknown field "spec.foo"`, 400), a value of the wrong JSON type
is a decoding error (400), and a missing required field is Invalid (422, by the caller).
"""

from __future__ import annotations

import datetime
import json
from functools import cache
from typing import Any

from .make_contract import CONTRACT


@cache
def contract() -> dict[str, Any]:
    return dict(json.loads(CONTRACT.read_text()))


class DecodeError(Exception):
    """A body the API server would not decode: `message` is the Status message."""


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _go_type(kind: str) -> str:
    if kind.startswith("[]"):
        return "[]" + _go_type(kind[2:])
    return {
        "string": "string",
        "integer": "int64",
        "number": "float64",
        "boolean": "bool",
        "date-time": "v1.Time",
        "int-or-string": "intstr.IntOrString",
        "map": "map[string]string",
    }.get(kind, kind.split(".")[-1])


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


class _Walker:
    def __init__(self, root: str) -> None:
        self.root = root
        self.unknown: list[str] = []
        self.wrong: list[str] = []
        self.missing: list[str] = []

    def wrong_type(self, value: Any, owner: str, path: str, kind: str) -> None:
        self.wrong.append(
            f"json: cannot unmarshal {_json_type(value)} into Go struct field "
            f"{owner}.{path} of type {_go_type(kind)}"
        )

    def walk(self, value: Any, kind: str, path: str, owner: str) -> None:
        if value is None:
            return
        if kind.startswith("[]"):
            if not isinstance(value, list):
                self.wrong_type(value, owner, path, kind)
                return
            for index, item in enumerate(value):
                self.walk(item, kind[2:], f"{path}[{index}]", owner)
            return
        ok = {
            "string": lambda v: isinstance(v, str),
            "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "boolean": lambda v: isinstance(v, bool),
            "int-or-string": lambda v: isinstance(v, (int, str)) and not isinstance(v, bool),
            "map": lambda v: isinstance(v, dict),
            "object": lambda v: True,
            "date-time": _is_time,
        }.get(kind)
        if ok is not None:
            if not ok(value):
                self.wrong_type(value, owner, path, kind)
            return
        spec = contract()["types"][kind]
        if not isinstance(value, dict):
            self.wrong_type(value, owner, path, kind)
            return
        for name, item in value.items():
            field_kind = spec["fields"].get(name)
            if field_kind is None:
                self.unknown.append(_join(path, name))
                continue
            self.walk(item, field_kind, _join(path, name), kind.split(".")[-1])
        for name in spec["required"]:
            if value.get(name) is None:
                self.missing.append(_join(path, name))


def _is_time(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


def check(kind: str, body: Any, strict: bool = True) -> tuple[list[str], list[str]]:
    """Check a body of `kind` (a root: Pod, Secret, DeleteOptions). Raises DecodeError
    for what the API answers 400; returns (unknown fields when not strict, missing
    required fields) for the caller to warn about or answer 422."""
    if not isinstance(body, dict):
        raise DecodeError(
            f'{kind} in version "v1" cannot be handled as a {kind}: json: cannot '
            f"unmarshal {_json_type(body)} into Go value of type struct"
        )
    walker = _Walker(kind)
    walker.walk(body, contract()["roots"][kind], "", kind)
    if walker.wrong:
        raise DecodeError(
            f'{kind} in version "v1" cannot be handled as a {kind}: {walker.wrong[0]}'
        )
    if walker.unknown and strict:
        raise DecodeError(
            "strict decoding error: "
            + ", ".join(f'unknown field "{name}"' for name in walker.unknown)
        )
    return walker.unknown, walker.missing
