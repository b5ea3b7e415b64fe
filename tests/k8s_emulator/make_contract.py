"""Make `contract.json`: the fields and types of the Kubernetes objects the emulator
accepts, from the installed `lightkube-models` (generated from Kubernetes' OpenAPI
document of the release its version names: 1.37.0.8 is Kubernetes v1.37).

    python -m tests.k8s_emulator.make_contract          # write contract.json again
    python -m tests.k8s_emulator.make_contract --check  # exit 1 if it no longer matches

Each type reachable from the roots (Pod, Secret, DeleteOptions, the list and status
kinds) is written as `{"fields": {jsonName: type}, "required": [...]}`, a type being
`string`, `integer`, `number`, `boolean`, `date-time`, `int-or-string`, `map` (any JSON
object: labels, resources, data), `object` (any JSON value), `[]T` (a list of T) or the
name of another type (`core_v1.PodSpec`).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import sys
import types
import typing
from importlib import metadata
from pathlib import Path
from typing import Any

CONTRACT = Path(__file__).with_name("contract.json")
PACKAGE = "lightkube-models"
# The kinds the emulator serves or reads (what a request body may be).
ROOTS = {
    "Pod": "lightkube.resources.core_v1:Pod",
    "Secret": "lightkube.resources.core_v1:Secret",
    "DeleteOptions": "lightkube.models.meta_v1:DeleteOptions",
    "Status": "lightkube.models.meta_v1:Status",
    "PodList": "lightkube.models.core_v1:PodList",
    "SecretList": "lightkube.models.core_v1:SecretList",
}
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _load(spec: str) -> type:
    module, name = spec.split(":")
    return getattr(__import__(module, fromlist=[name]), name)  # type: ignore[no-any-return]


def _type_name(cls: type) -> str:
    return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"


def _describe(tp: Any, pending: list[type]) -> str:
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        if sorted(args, key=str) == sorted([int, str], key=str):
            return "int-or-string"
        if len(args) == 1:
            return _describe(args[0], pending)
        raise ValueError(f"union not understood: {tp}")
    if origin in (list, typing.List):  # noqa: UP006 - the models' own spelling
        return "[]" + _describe(args[0], pending)
    if tp in _SCALARS:
        return _SCALARS[tp]
    if tp in (dict, typing.Dict) or origin in (dict, typing.Dict):  # noqa: UP006
        return "map"
    if tp is datetime.datetime:
        return "date-time"
    if tp is typing.Any or tp is object:
        return "object"
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        pending.append(tp)
        return _type_name(tp)
    raise ValueError(f"type not understood: {tp}")


def build() -> dict[str, Any]:
    """The contract from the installed models (without the day it was taken)."""
    roots = {kind: _load(spec) for kind, spec in ROOTS.items()}
    pending: list[type] = list(roots.values())
    described: dict[str, Any] = {}
    while pending:
        cls = pending.pop()
        name = _type_name(cls)
        if name in described:
            continue
        hints = typing.get_type_hints(cls)
        fields: dict[str, str] = {}
        required: list[str] = []
        for field in dataclasses.fields(cls):
            json_name = field.metadata.get("json", field.name)
            fields[json_name] = _describe(hints[field.name], pending)
            if (
                field.default is dataclasses.MISSING
                and field.default_factory is dataclasses.MISSING
            ):
                required.append(json_name)
        described[name] = {"fields": dict(sorted(fields.items())), "required": sorted(required)}
    models = Path(_load("lightkube.models.core_v1:__file__")).parent
    digest = hashlib.sha256()
    for module in ("core_v1.py", "meta_v1.py"):
        digest.update((models / module).read_bytes())
    version = metadata.version(PACKAGE)
    return {
        "x-source": {
            "package": f"{PACKAGE}=={version}",
            "kubernetes": "v" + ".".join(version.split(".")[:2]),
            "from": "lightkube-models' dataclasses, generated from the Kubernetes OpenAPI "
            "document of that release (https://github.com/gtsystem/lightkube-models)",
            "sha256(core_v1.py+meta_v1.py)": digest.hexdigest(),
        },
        "roots": {kind: _type_name(cls) for kind, cls in roots.items()},
        "types": dict(sorted(described.items())),
    }


def differs(contract: dict[str, Any], built: dict[str, Any]) -> list[str]:
    """What differs between a contract file and the installed models (the day aside)."""
    notes: list[str] = []
    source = {k: v for k, v in contract.get("x-source", {}).items() if k != "taken"}
    if source != built["x-source"]:
        notes.append(f"x-source: file {source}, installed {built['x-source']}")
    for key in ("roots", "types"):
        if contract.get(key) != built[key]:
            names = set(contract.get(key, {})) ^ set(built[key])
            changed = [
                n
                for n in set(contract.get(key, {})) & set(built[key])
                if contract[key][n] != built[key][n]
            ]
            notes.append(
                f"{key}: added/removed {sorted(names)[:10]}, changed {sorted(changed)[:10]}"
            )
    return notes


def main(argv: list[str]) -> int:
    built = build()
    if "--check" in argv:
        notes = differs(json.loads(CONTRACT.read_text()), built)
        for note in notes:
            print(note, file=sys.stderr)
        return 1 if notes else 0
    built["x-source"]["taken"] = datetime.date.today().isoformat()
    CONTRACT.write_text(json.dumps(built, indent=1, sort_keys=False) + "\n")
    print(f"wrote {CONTRACT} ({len(built['types'])} types)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
