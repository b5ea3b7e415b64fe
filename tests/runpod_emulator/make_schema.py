"""Make `runpod-rest-v2.schema.json`, the emulator's validator, from RunPod's OpenAPI document.

    python -m tests.runpod_emulator.make_schema /path/to/openapi.json [--taken YYYY-MM-DD]

RunPod publishes its REST v2 OpenAPI document at https://api.runpod.io/v2/openapi.json.
This keeps its structure only: paths, methods, parameters, request and response bodies,
and every schema keyword that validates (types, enums, required lists, formats, bounds,
patterns, `unevaluatedProperties`, ...). Descriptions, summaries, examples, tags and other
prose are dropped. A top-level `x-source` records the URL, the document's version and the
date the copy was taken. Before writing, it checks that the emulator's validator
(openapi.py) reports the same errors with the result as with the original document, on
instances made from the document's own examples. Run by hand to refresh the file; the
tests never run it.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .openapi import SCHEMA_PATH, OpenApiSchemas

SOURCE_URL = "https://api.runpod.io/v2/openapi.json"

# --- what is kept, per kind of object ---------------------------------------------------
# JSON Schema 2020-12 keywords whose value is a schema, a list of schemas, a map of them.
_SUBSCHEMA = {
    "items", "not", "if", "then", "else", "contains", "propertyNames", "contentSchema",
    "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
}  # fmt: skip
_SUBSCHEMA_LIST = {"allOf", "anyOf", "oneOf", "prefixItems"}
_SUBSCHEMA_MAP = {"properties", "patternProperties", "dependentSchemas", "$defs"}
# Keywords kept as they are: references, validation, and the few structural annotations.
_SCHEMA_VALUES = {
    "$ref", "$dynamicRef", "$anchor", "$dynamicAnchor", "$id", "$schema",
    "type", "enum", "const", "required", "dependentRequired", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minLength", "maxLength", "pattern", "minItems", "maxItems", "uniqueItems",
    "minContains", "maxContains", "minProperties", "maxProperties",
    "contentEncoding", "contentMediaType", "nullable", "discriminator",
    "default", "readOnly", "writeOnly", "deprecated",
}  # fmt: skip
# Prose and illustration: dropped without a word. Any other key is dropped with a warning
# (a refresh that meets a new keyword should look at it).
_PROSE = {
    "description", "summary", "title", "example", "examples", "externalDocs", "tags",
    "$comment", "xml", "links", "callbacks", "contact", "license", "termsOfService",
}  # fmt: skip

_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
# OpenAPI objects: key -> how its value is made (None: kept as it is).
_OPENAPI: dict[str, dict[str, str | None]] = {
    "document": {
        "openapi": None, "jsonSchemaDialect": None, "info": "info", "servers": "servers",
        "security": None, "components": "components", "paths": "paths",
    },
    "info": {"title": None, "version": None},
    "server": {"url": None},
    "components": {
        "schemas": "schema-map", "responses": "response-map", "parameters": "parameter-map",
        "headers": "header-map", "requestBodies": "body-map",
        "securitySchemes": "security-map",
    },
    "path": {"$ref": None, "parameters": "parameters", **dict.fromkeys(_METHODS, "operation")},
    "operation": {
        "operationId": None, "parameters": "parameters", "requestBody": "body",
        "responses": "response-map", "security": None, "deprecated": None,
    },
    "parameter": {
        "$ref": None, "name": None, "in": None, "required": None, "deprecated": None,
        "allowEmptyValue": None, "style": None, "explode": None, "allowReserved": None,
        "schema": "schema", "content": "content",
    },
    "header": {
        "$ref": None, "required": None, "deprecated": None, "style": None, "explode": None,
        "schema": "schema", "content": "content",
    },
    "body": {"$ref": None, "required": None, "content": "content"},
    "response": {"$ref": None, "headers": "header-map", "content": "content"},
    "media": {"schema": "schema"},
    "security": {
        "type": None, "scheme": None, "bearerFormat": None, "in": None, "name": None,
        "openIdConnectUrl": None, "flows": None,
    },
}  # fmt: skip


class _Stripper:
    def __init__(self) -> None:
        self.unknown: list[str] = []

    def schema(self, node: Any, at: str) -> Any:
        if not isinstance(node, dict):
            return node  # `true` / `false`
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _SUBSCHEMA:
                out[key] = self.schema(value, f"{at}/{key}")
            elif key in _SUBSCHEMA_LIST:
                out[key] = [self.schema(v, f"{at}/{key}/{i}") for i, v in enumerate(value)]
            elif key in _SUBSCHEMA_MAP:
                out[key] = {n: self.schema(v, f"{at}/{key}/{n}") for n, v in value.items()}
            elif key in _SCHEMA_VALUES:
                out[key] = value
            else:
                self._drop(key, at)
        return out

    def openapi(self, kind: str, node: Any, at: str) -> Any:
        if kind == "schema":
            return self.schema(node, at)
        if kind == "servers":
            return [self.openapi("server", s, f"{at}/{i}") for i, s in enumerate(node)]
        if kind == "parameters":
            return [self.openapi("parameter", p, f"{at}/{i}") for i, p in enumerate(node)]
        if kind == "content":
            return {t: self.openapi("media", m, f"{at}/{t}") for t, m in node.items()}
        if kind == "paths":
            return {p: self.openapi("path", item, f"{at}/{p}") for p, item in node.items()}
        if kind.endswith("-map"):
            item = kind.removesuffix("-map")
            return {n: self.openapi(item, v, f"{at}/{n}") for n, v in node.items()}
        fields = _OPENAPI[kind]
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in fields:
                made = fields[key]
                out[key] = value if made is None else self.openapi(made, value, f"{at}/{key}")
            else:
                self._drop(key, at)
        return out

    def _drop(self, key: str, at: str) -> None:
        if key not in _PROSE and not key.startswith("x-"):
            self.unknown.append(f"{at or '#'}: {key}")


def structure_only(document: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The document without prose, and the unexpected keys that were dropped."""
    stripper = _Stripper()
    return stripper.openapi("document", document, "#"), stripper.unknown


# --- the check: same errors from the emulator's validator ---------------------------------


def _examples(node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        yield from node.get("examples") or []
        if "example" in node:
            yield node["example"]


def _assembled(schema: Any) -> dict[str, Any]:
    """An object made of each property's first example, through allOf branches."""
    out: dict[str, Any] = {}
    if not isinstance(schema, dict):
        return out
    for name, prop in (schema.get("properties") or {}).items():
        for example in _examples(prop):
            out[name] = example
            break
    for branch in schema.get("allOf") or []:
        out.update(_assembled(branch))
    return out


def _instances(document: dict[str, Any]) -> dict[str, list[Any]]:
    schemas = document["components"]["schemas"]
    found: dict[str, list[Any]] = {name: [{}, [], "x", None] for name in schemas}
    for name, schema in schemas.items():
        found[name] += [*_examples(schema), _assembled(schema)]

    def media(node: Any) -> None:  # examples of bodies whose schema is a named one
        if isinstance(node, dict):
            schema = node.get("schema")
            ref = schema.get("$ref", "") if isinstance(schema, dict) else ""
            name = ref.removeprefix("#/components/schemas/")
            if name in found:
                found[name] += [node["example"]] if "example" in node else []
                named = node.get("examples")
                named = named.values() if isinstance(named, dict) else []
                found[name] += [e["value"] for e in named if isinstance(e, dict) and "value" in e]
            for value in node.values():
                media(value)
        elif isinstance(node, list):
            for value in node:
                media(value)

    # (any value is a fair case: a wrong guess only adds one more comparison)
    media({"paths": document["paths"], "responses": document["components"].get("responses")})
    for cases in found.values():
        cases += [{**case, "x-not-a-field": 1} for case in cases if isinstance(case, dict)]
    return found


def same_errors(original: dict[str, Any], stripped: dict[str, Any]) -> tuple[int, int]:
    """Compare the validators' errors; raise on a difference. Returns (cases, failing)."""
    before, after = OpenApiSchemas(original), OpenApiSchemas(stripped)
    cases = failing = 0
    for name, instances in _instances(original).items():
        for instance in instances:
            expected = before.errors(name, instance)
            if after.errors(name, instance) != expected:
                raise SystemExit(f"errors differ for {name} on {json.dumps(instance)[:200]}")
            cases += 1
            failing += bool(expected)
    return cases, failing


# --- the command --------------------------------------------------------------------------


def make(source: Path, taken: datetime.date, url: str) -> tuple[dict[str, Any], list[str]]:
    raw = source.read_bytes()
    document = json.loads(raw)
    stripped, unknown = structure_only(document)
    record = {
        "url": url,
        "title": document["info"]["title"],
        "version": document["info"]["version"],
        "taken": taken.isoformat(),
        "sha256": hashlib.sha256(raw).hexdigest(),
        "kept": "structure only (paths, methods, parameters, bodies, validation keywords); "
        "descriptions, examples and other prose dropped",
        "made-by": "python -m tests.runpod_emulator.make_schema",
    }
    return {"x-source": record, **stripped}, unknown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.runpod_emulator.make_schema", description=__doc__.split("\n")[0]
    )
    parser.add_argument("source", type=Path, help="a copy of RunPod's OpenAPI document")
    parser.add_argument(
        "--taken",
        type=datetime.date.fromisoformat,
        default=datetime.datetime.now(datetime.UTC).date(),
        help="the date the copy was taken from RunPod (default: today, UTC)",
    )
    parser.add_argument("--url", default=SOURCE_URL, help="where it was taken: %(default)s")
    parser.add_argument("--output", type=Path, default=SCHEMA_PATH, help="default: %(default)s")
    args = parser.parse_args(argv)

    made, unknown = make(args.source, args.taken, args.url)
    for where in unknown:
        print(f"dropped an unexpected key (look at it): {where}", file=sys.stderr)
    cases, failing = same_errors(json.loads(args.source.read_bytes()), made)
    text = json.dumps(made, indent=1, ensure_ascii=False) + "\n"
    args.output.write_text(text, encoding="utf-8")
    print(
        f"wrote {args.output} ({len(text)} bytes, from {args.source.stat().st_size}); "
        f"same errors on {cases} instances ({failing} invalid)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
