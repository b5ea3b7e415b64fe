"""RunPod's published OpenAPI schemas, used as the validator for request bodies.

Validating against RunPod's own document (instead of a hand copy of its rules) keeps the
emulator honest. The document lives in the repository as `runpod-rest-v2.schema.json`:
its structure only (no prose), made from a copy of RunPod's file by make_schema.py, which
records where and when the copy was taken in its `x-source`. Refresh it with that script
and the emulator's 422s follow. OpenAPI 3.1 schemas are JSON Schema 2020-12, so
`unevaluatedProperties: false` (RunPod's "unknown fields -> 422") needs the 2020-12
validator.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator, ValidationError
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SCHEMA_PATH = Path(__file__).resolve().with_name("runpod-rest-v2.schema.json")
_BASE_URI = "urn:runpod:openapi-v2"


class OpenApiSchemas:
    """Validators for named schemas of `components.schemas`."""

    def __init__(self, document: dict[str, Any], path: Path | None = None) -> None:
        self.document = document
        self.path = path  # the file it was read from, if any
        resource = Resource.from_contents(document, default_specification=DRAFT202012)
        self._registry: Registry[Any] = Registry().with_resource(_BASE_URI, resource)
        self._validators: dict[str, Draft202012Validator] = {}

    @classmethod
    def load(cls) -> OpenApiSchemas:
        """The schemas of the repository's file (read once per process)."""
        return _load_cached(str(SCHEMA_PATH))

    def schema_names(self) -> list[str]:
        return list(self.document["components"]["schemas"])

    def errors(self, schema_name: str, instance: Any) -> list[str]:
        """Every violation as `<json path>: <message>`, the shape of RunPod's `errors` list."""
        messages: list[str] = []
        for error in self._validator(schema_name).iter_errors(instance):
            message = self._message(error)
            if message and message not in messages:
                messages.append(message)
        return sorted(messages)

    def _message(self, error: ValidationError) -> str | None:
        if error.validator != "unevaluatedProperties":
            return f"{error.json_path}: {error.message}"
        # JSON Schema drops the annotations of a failing allOf branch, so one bad field makes
        # every sibling "unevaluated". Report only names no branch declares, in RunPod's
        # wording, and leave the real cause to its own error.
        declared = self._declared_properties(error.schema)
        unknown = sorted(set(error.instance) - declared) if isinstance(error.instance, dict) else []
        if not unknown:
            return None
        names = ", ".join(f"'{name}'" for name in unknown)
        return f"{error.json_path}: additional properties {names} not allowed"

    def _declared_properties(self, schema: Any) -> set[str]:
        if not isinstance(schema, dict):
            return set()
        if "$ref" in schema:
            ref = schema["$ref"]
            target = ref if ref.startswith(_BASE_URI) else f"{_BASE_URI}{ref}"
            schema = {**schema, **self._registry.resolver().lookup(target).contents}
            schema.pop("$ref", None)
        names = set(schema.get("properties", {}))
        for keyword in ("allOf", "anyOf", "oneOf"):
            for branch in schema.get(keyword, []):
                names |= self._declared_properties(branch)
        for keyword in ("then", "else"):
            names |= self._declared_properties(schema.get(keyword))
        return names

    def _validator(self, schema_name: str) -> Draft202012Validator:
        if schema_name not in self._validators:
            if schema_name not in self.document["components"]["schemas"]:
                raise KeyError(f"no schema {schema_name!r} in the OpenAPI document")
            ref = {"$ref": f"{_BASE_URI}#/components/schemas/{schema_name}"}
            self._validators[schema_name] = Draft202012Validator(ref, registry=self._registry)
        return self._validators[schema_name]


@lru_cache(maxsize=1)
def _load_cached(path: str) -> OpenApiSchemas:
    file = Path(path)
    return OpenApiSchemas(json.loads(file.read_text(encoding="utf-8")), path=file)
