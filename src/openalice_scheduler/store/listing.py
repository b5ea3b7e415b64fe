"""Listings of many leases as one JSON array, cheap enough for 10,000 leases.

Encoding a lease (its dict, two RFC 3339 times, the JSON) costs more than reading its
row, so each lease's encoding is remembered *keyed by the row it was made from*: the
encoding is a pure function of that row, so a hit is right by construction, whatever
wrote the row and however. Only the encodings of the last listing are kept."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from openalice_scheduler.store.records import WIRE_COLUMNS, encode_json, wire_of
from openalice_scheduler.store.schema import leases


class ListingEncoder:
    """Encodes `select(WIRE_COLUMNS)` rows, remembering the last listing's encodings."""

    def __init__(self) -> None:
        self._last: dict[tuple[Any, ...], bytes] = {}

    def encode(self, rows: Sequence[tuple[Any, ...]]) -> bytes:
        last, kept = self._last, {}
        parts = []
        for row in rows:
            part = last.get(row)
            if part is None:
                part = encode_json(wire_of(row)).encode()
            kept[row] = part
            parts.append(part)
        self._last = kept
        return b"[" + b",".join(parts) + b"]"


def wire_rows(conn: Connection, states: Sequence[str]) -> list[tuple[Any, ...]]:
    """The rows of WIRE_COLUMNS of the leases in `states`, oldest first."""
    query = (select(*WIRE_COLUMNS).where(leases.c.state.in_(list(states)))
             .order_by(leases.c.created_at))
    return [tuple(row) for row in conn.execute(query)]
