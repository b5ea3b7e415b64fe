"""The configuration reference (docs/reference/configuration.md), made from the settings
models: every variable with its type and bounds, default and description, in the
section of the area it belongs to (`AREAS`). The page is committed; tests/test_site.py
fails when it differs from what the models say, so it cannot drift:

    python -m openalice_scheduler.config.reference > docs/reference/configuration.md
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any, Literal

import annotated_types
from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from openalice_scheduler.config import AREAS

# Read by the libraries the service uses, not by its settings: named here so that the
# reference lists every variable that changes what the service does.
LIBRARIES = (
    (
        "KUBECONFIG",
        "the kubeconfig of the kubernetes provider, when the scheduler does not run in a "
        "pod (there its service account is used): one file, or several separated by `:`, "
        "merged as kubectl merges them; unset: `~/.kube/config`.",
    ),
    (
        "MODAL_SERVER_URL",
        "the modal client's: where Modal's API is (the tests point it at their emulator).",
    ),
    (
        "SSL_CERT_FILE",
        "OpenSSL's: the CA bundle trusted by the scheduler's own HTTPS calls to workers "
        "(probes, hand-offs and notices through a Modal tunnel or RunPod's proxy).",
    ),
)

HEAD = """# Configuration

<!-- Made by `python -m openalice_scheduler.config.reference` from the settings models
(src/openalice_scheduler/config/); tests/test_site.py fails when it differs. Do not edit
by hand: change a field's description, default or bounds there and run it again. -->

Every setting is an environment variable (its name in any case). An invalid value stops
start-up with one line naming the variable and the rule it breaks, all of them at once
([Start-up errors](../operations/startup-errors.md)). Unset means the default.
"""


def page() -> str:
    parts = [HEAD]
    for title, area in AREAS:
        parts.append(f"## {title}\n\n{_docstring(area)}\n")
        parts.append("| variable | type | default | meaning |\n|---|---|---|---|")
        for name, field in area.model_fields.items():
            parts.append(
                f"| `{name.upper()}` | {_cell(_type(field))} | {_cell(_default(field))} | "
                f"{_cell(field.description or '')} |"
            )
        parts.append("")
    parts.append("## Read by libraries\n")
    parts.append("| variable | meaning |\n|---|---|")
    parts += [f"| `{name}` | {_cell(meaning)} |" for name, meaning in LIBRARIES]
    return "\n".join(parts) + "\n"


def _docstring(area: type) -> str:
    return " ".join((inspect.getdoc(area) or "").split())


def _type(field: FieldInfo) -> str:
    shown = _annotation(field.annotation)
    bounds = []
    for rule in field.metadata:
        for kind, attribute, sign in (
            (annotated_types.Ge, "ge", "≥"),
            (annotated_types.Gt, "gt", ">"),
            (annotated_types.Le, "le", "≤"),
            (annotated_types.Lt, "lt", "<"),
        ):
            if isinstance(rule, kind):
                bounds.append(f"{sign} {_number(getattr(rule, attribute))}")
        if isinstance(rule, annotated_types.MinLen) and rule.min_length > 0:
            bounds.append(f"at least {rule.min_length} characters")
        if isinstance(rule, annotated_types.MaxLen):
            bounds.append(f"at most {rule.max_length} characters")
    return shown + (f", {' and '.join(bounds)}" if bounds else "")


def _annotation(annotation: Any) -> str:
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_annotation(a) for a in args if a is not type(None))
    if origin is Literal:
        return " or ".join(f"`{a}`" for a in args)
    names = {str: "text", int: "integer", float: "number", bool: "`true` or `false`"}
    if annotation is SecretStr:
        return "text (secret)"
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.default
    if value is None or value is PydanticUndefined:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int | float):
        return f"`{_number(value)}`"
    return f"`{value}`"


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":
    print(page(), end="")
