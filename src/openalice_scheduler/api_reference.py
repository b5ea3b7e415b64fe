"""The HTTP API's reference page (docs/reference/openapi.md), made from the OpenAPI
document the service serves at /openapi.json: every operation with its parameters, body
and answers, and every schema with its fields. The page is committed; tests/test_site.py
fails when it differs from what the app says, so it cannot drift:

    python -m openalice_scheduler.api_reference > docs/reference/openapi.md
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from openalice_scheduler.app import create_app
from openalice_scheduler.config import Settings

HEAD = """# Operations and schemas

<!-- Made by `python -m openalice_scheduler.api_reference` from the OpenAPI document the
service serves (/openapi.json); tests/test_site.py fails when it differs. Do not edit by
hand: change a route's or a model's docstring or description and run it again. -->

Every operation of the HTTP API as the service's own OpenAPI document describes it, with
its parameters, body and answers, then every schema. The rules behind them (who may
renew, the line, the error shape) are explained in [HTTP API](api.md); a running service
serves the same document at `/openapi.json` and interactive docs at `/docs`.
"""


def document() -> dict[str, Any]:
    """The OpenAPI document of an app built with no provider, on a throw-away SQLite
    file (nothing is served or migrated: the document depends on neither)."""
    with tempfile.TemporaryDirectory() as where:
        settings = Settings(  # type: ignore[call-arg]  # the rest: their defaults
            internal_secret="reference-" + "x" * 32,  # type: ignore[arg-type]
            database_url=f"sqlite:///{Path(where) / 'reference.db'}",
        )
        return create_app(settings, providers=[]).openapi()


def page(doc: dict[str, Any]) -> str:
    operations = [
        (method.upper(), path, operation)
        for path, methods in doc["paths"].items()
        for method, operation in methods.items()
    ]
    # Answers every operation gives alike (bad framing of the request), said once.
    shared = _shared_answers([op for _, _, op in operations])
    parts = [HEAD, "## Operations\n"]
    parts.append(
        "| operation | id | summary |\n|---|---|---|\n"
        + "\n".join(
            f"| [`{method} {path}`](#{_anchor(op['operationId'])}) | `{op['operationId']}` "
            f"| {_cell(op.get('summary', ''))} |"
            for method, path, op in operations
        )
        + "\n"
    )
    parts.append(
        "Every operation may also answer: "
        + "; ".join(f"**{code}** {_cell(text)}" for code, text in sorted(shared.items()))
        + ". Each error body is an [ErrorBody](#errorbody).\n"
    )
    for method, path, op in operations:
        parts.append(_operation(method, path, op, shared))
    parts.append("## Schemas\n")
    for name, schema in doc["components"]["schemas"].items():
        parts.append(_schema(name, schema))
    return "\n".join(parts).rstrip() + "\n"


def _shared_answers(operations: list[dict[str, Any]]) -> dict[str, str]:
    first = {code: a["description"] for code, a in operations[0]["responses"].items()}
    return {
        code: text
        for code, text in first.items()
        if all(op["responses"].get(code, {}).get("description") == text for op in operations)
    }


def _operation(method: str, path: str, op: dict[str, Any], shared: dict[str, str]) -> str:
    lines = [
        f"### `{method} {path}` {{#{_anchor(op['operationId'])}}}\n",
        f"**{op.get('summary', '')}** (`{op['operationId']}`)\n",
    ]
    if description := op.get("description"):
        lines.append(f"{description.strip()}\n")
    if params := op.get("parameters"):
        lines.append("| parameter | in | type | required | meaning |\n|---|---|---|---|---|")
        for p in params:
            lines.append(
                f"| `{p['name']}` | {p['in']} | {_type(p.get('schema', {}))} "
                f"| {'yes' if p.get('required') else 'no'} "
                f"| {_cell(p.get('description') or p.get('schema', {}).get('description', ''))} |"
            )
        lines.append("")
    if body := op.get("requestBody"):
        schema = body["content"]["application/json"]["schema"]
        required = "required" if body.get("required") else "optional"
        lines.append(f"Body ({required}): {_type(schema)}.\n")
    lines.append("| answer | body | meaning |\n|---|---|---|")
    for code, answer in op["responses"].items():
        if shared.get(code) == answer["description"]:
            continue
        schema = answer.get("content", {}).get("application/json", {}).get("schema")
        body_type = _type(schema) if schema else "—"
        lines.append(f"| {code} | {body_type} | {_cell(answer['description'])} |")
    return "\n".join(lines) + "\n"


def _schema(name: str, schema: dict[str, Any]) -> str:
    lines = [f"### {name} {{#{name.lower()}}}\n"]
    if description := schema.get("description"):
        lines.append(f"{description.strip()}\n")
    if "enum" in schema:
        values = ", ".join(f"`{v}`" for v in schema["enum"])
        lines.append(f"One of {values}.\n")
    properties = schema.get("properties", {})
    if properties:
        required = set(schema.get("required", ()))
        lines.append("| field | type | required | meaning |\n|---|---|---|---|")
        for field, spec in properties.items():
            lines.append(
                f"| `{field}` | {_type(spec)} | {'yes' if field in required else 'no'} "
                f"| {_cell(spec.get('description', ''))} |"
            )
    return "\n".join(lines) + "\n"


def _type(schema: dict[str, Any]) -> str:
    """A schema's type in a few words, with links to named schemas."""
    if ref := schema.get("$ref"):
        name = ref.rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if variants := schema.get("anyOf") or schema.get("oneOf"):
        return " or ".join(_type(v) for v in variants)
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{schema['const']}`"
    kind = schema.get("type")
    if kind == "array":
        return f"array of {_type(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema:
        values = schema["additionalProperties"]
        return f"object of {_type(values)}" if isinstance(values, dict) else "object"
    if kind is None:
        return "any"
    bounds = [
        f"{word} {schema[key]}"
        for key, word in (
            ("minimum", "≥"),
            ("exclusiveMinimum", ">"),
            ("maximum", "≤"),
            ("exclusiveMaximum", "<"),
            ("minLength", "length ≥"),
            ("maxLength", "length ≤"),
        )
        if key in schema
    ]
    name = f"{kind} ({schema['format']})" if "format" in schema else str(kind)
    return f"{name}, {', '.join(bounds)}" if bounds else name


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _anchor(operation_id: str) -> str:
    return operation_id.replace("_", "-")


if __name__ == "__main__":
    print(page(document()), end="")
