"""Lease ids: random version-4 UUIDs in canonical form."""

from __future__ import annotations

import re
import uuid

_CANONICAL = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE
)


def new_lease_id() -> str:
    return str(uuid.uuid4())


def is_lease_id(value: str) -> bool:
    """Whether `value` is a UUID in canonical form (as every lease id is)."""
    return _CANONICAL.fullmatch(value) is not None
