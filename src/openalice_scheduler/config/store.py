"""The state store: which database, how SQLite commits, how long ended leases are kept
(docs/operations/replicas.md#several-replicas-on-postgresql)."""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError


class StoreSettings(BaseSettings):
    """Where leases are kept: one SQLite file for one process, or a PostgreSQL database
    that several replicas share."""

    database_url: str = Field(
        "sqlite:///./openalice-scheduler.db",
        description="The state store: sqlite:///path (WAL mode, one process per file), or "
        "postgresql://user:pass@host/db for replicas.",
    )
    sqlite_synchronous: Literal["full", "normal"] = Field(
        "full",
        description="full: a lease is answered only once its commit is on disk and "
        "survives power loss; normal: no fsync per commit, survives a killed process, faster "
        "on slow disks.",
    )
    lease_retention_days: int = Field(
        90,
        ge=0,
        description="Ended leases older than this are purged in the background, hourly, by "
        "every replica; 0 = kept for ever.",
    )

    @field_validator("database_url")
    @classmethod
    def _known_database(cls, value: str) -> str:
        if not re.match(r"^(sqlite|postgresql|postgres)(\+\w+)?://", value):
            raise ValueError("must start with sqlite:/// or postgresql://")
        # Parsed now, so that a bad URL is reported with the other variables. The
        # parser's own message is not repeated: it may quote the password.
        try:
            make_url(value)
        except (ArgumentError, ValueError):
            raise ValueError(
                "is not a valid URL (is the port a number? is a special "
                "character in the password percent-encoded?)"
            ) from None
        return value


def url_passwords(url: str) -> list[str]:
    """The password of a database URL, decoded and as written (percent-encoded), and any
    password among its query parameters (`?password=…`, libpq's `sslpassword=…`)."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return []
    found = [str(parsed.password or ""), urlsplit(url).password or ""]
    for key, value in parsed.query.items():
        if "password" in key.lower():
            found += [value] if isinstance(value, str) else list(value)
    return found
