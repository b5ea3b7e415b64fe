"""The contract the emulator was checked against: `contract.json` beside this file.

It is the part of Modal's protocol the emulator answers, taken from the installed
`modal` wheel (which ships compiled stubs, not `.proto` files): for each emulated RPC its
request and reply types and cardinality (the service in `modal_proto/api_pb2.py`, which
`api_grpc.py` is made from), and every field
(name, number, type, repeated) of the messages the emulator reads or writes
(`modal_proto/api_pb2.py`). `x-source` names the package version, the SHA-256 of both
files and the day it was taken.

    python -m tests.modal_emulator.make_contract            # write contract.json
    python -m tests.modal_emulator.make_contract --check    # exit 1 if it differs

tests/test_modal_emulator.py checks that the installed client still matches it; after
a deliberate upgrade of `modal`, run this, read the diff (every changed message is a
place where the emulator may now answer wrongly), fix the emulator and commit both.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from modal_proto import api_pb2

from .servicer import EMULATED_RPCS

CONTRACT = Path(__file__).with_name("contract.json")
# Messages the emulator reads or writes besides the RPCs' own requests and replies.
MESSAGES_USED = (
    "AppHandleMetadata",
    "EnvironmentMetadata",
    "EnvironmentSettings",
    "GPUConfig",
    "GenericResult",
    "Image",
    "ImageMetadata",
    "ImageRegistryConfig",
    "PortSpec",
    "PortSpecs",
    "Resources",
    "Sandbox",
    "SandboxHandleMetadata",
    "SandboxInfo",
    "SandboxTag",
    "SchedulerPlacement",
    "SecretMetadata",
    "SecretSource",
    "StringMap",
    "TaskInfo",
    "TunnelData",
)
_TYPE_NAMES = {
    value: name.removeprefix("TYPE_").lower()
    for name, value in vars(FieldDescriptor).items()
    if name.startswith("TYPE_")
}
_SOURCE_FILES = ("modal_proto/api_pb2.py", "modal_proto/api_grpc.py")


def _field(field: FieldDescriptor) -> str:
    kind = field.message_type.full_name if field.message_type else _TYPE_NAMES[field.type]
    if field.enum_type is not None:
        kind = field.enum_type.full_name
    return f"{field.number} {'repeated ' if field.is_repeated else ''}{kind}"


def _message(descriptor: Descriptor) -> dict[str, str]:
    return {field.name: _field(field) for field in descriptor.fields}


def _rpcs() -> dict[str, dict[str, str]]:
    service = api_pb2.DESCRIPTOR.services_by_name["ModalClient"]
    found = {}
    for method in service.methods:
        if method.name in EMULATED_RPCS:
            streaming = (
                ("STREAM" if method.client_streaming else "UNARY")
                + "_"
                + ("STREAM" if method.server_streaming else "UNARY")
            )
            found[method.name] = {
                "request": method.input_type.full_name,
                "reply": method.output_type.full_name,
                "cardinality": streaming,
            }
    return dict(sorted(found.items()))


def build(taken: str | None = None) -> dict[str, Any]:
    rpcs = _rpcs()
    names = {n for rpc in rpcs.values() for n in (rpc["request"], rpc["reply"])}
    names |= {getattr(api_pb2, n).DESCRIPTOR.full_name for n in MESSAGES_USED}
    pool = api_pb2.DESCRIPTOR.pool
    messages = {name: _message(pool.FindMessageTypeByName(name)) for name in sorted(names)}
    distribution = metadata.distribution("modal")
    digests = {}
    for relative in _SOURCE_FILES:
        path = Path(str(distribution.locate_file(relative)))
        digests[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return {
        "x-source": {
            "package": "modal",
            "version": distribution.version,
            "files": digests,
            "taken": taken or datetime.date.today().isoformat(),
        },
        "rpcs": rpcs,
        "messages": messages,
    }


def differences(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What changed, ignoring the day it was taken."""
    found = []
    for key in ("version", "files"):
        if stored["x-source"][key] != current["x-source"][key]:
            found.append(f"x-source.{key}: {stored['x-source'][key]} -> {current['x-source'][key]}")
    for section in ("rpcs", "messages"):
        for name in sorted(set(stored[section]) | set(current[section])):
            if stored[section].get(name) != current[section].get(name):
                found.append(f"{section}.{name} differs")
    return found


def load() -> dict[str, Any]:
    return dict(json.loads(CONTRACT.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.modal_emulator.make_contract")
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    parser.add_argument("--taken", default=None, help="the day to record (default today)")
    args = parser.parse_args(argv)
    current = build(args.taken)
    if args.check:
        changed = differences(load(), current)
        for line in changed:
            print(line)
        return 1 if changed else 0
    CONTRACT.write_text(json.dumps(current, indent=1) + "\n")
    print(f"wrote {CONTRACT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
