"""Listings of many leases as one JSON array, cheap enough for 10,000 leases.

Reading and encoding every lease (its dict, two RFC 3339 times, the JSON) on every
listing costs far more than it needs to, so each lease's encoding is kept with the
row's `revision`, which the database itself bumps on every UPDATE of the row, whoever
makes it (a trigger, migration 0005). A listing reads only (lease_id, revision) of the
leases it shows, reuses the encodings whose revision is unchanged, and reads and encodes
the rest. Nothing outside this module and that trigger has to hold for a reused
encoding to be the row's: lease ids are never reused (uuid4). Only the encodings of the
last listing are kept."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.engine import Connection

from openalice_scheduler.store.records import WIRE_COLUMNS, encode_json, wire_of
from openalice_scheduler.store.schema import leases

# More changed leases than this: read every listed row in one query, not by id.
_READ_ALL_OVER = 1000
_BATCH = 500


class ListingEncoder:
    def __init__(self) -> None:
        # lease_id -> (revision, encoded Lease), for the leases of the last listing.
        self._last: dict[str, tuple[int, bytes]] = {}

    def list_json(self, conn: Connection, states: Sequence[str]) -> bytes:
        """The leases in `states` as a JSON array of `Lease`, oldest first. Run in one
        read transaction."""
        in_states = leases.c.state.in_(list(states))
        keys = conn.execute(
            select(leases.c.lease_id, leases.c.revision)
            .where(in_states)
            .order_by(leases.c.created_at, leases.c.lease_id)
        ).all()
        last, kept = self._last, {}
        parts: list[bytes] = []
        missing: dict[str, int] = {}  # lease_id -> its place in `parts`
        for lease_id, revision in keys:
            hit = last.get(lease_id)
            if hit is not None and hit[0] == revision:
                kept[lease_id] = hit
                parts.append(hit[1])
            else:
                missing[lease_id] = len(parts)
                parts.append(b"")
        if missing:
            query = select(leases.c.revision, *WIRE_COLUMNS).where(in_states)
            ids = list(missing)
            batches = (
                [
                    query.where(leases.c.lease_id.in_(ids[i : i + _BATCH]))
                    for i in range(0, len(ids), _BATCH)
                ]
                if len(ids) <= _READ_ALL_OVER
                else [query]
            )
            for batch in batches:
                for revision, *row in conn.execute(batch):
                    place = missing.get(row[0])
                    if place is not None:
                        kept[row[0]] = (revision, encode_json(wire_of(row)).encode())
                        parts[place] = kept[row[0]][1]
        self._last = kept
        # A lease that left `states` between the two reads (no snapshot) is not shown.
        shown = [part for part in parts if part]
        if not shown:
            return b"[]"
        # The brackets go on the end parts, so the array is built in one allocation:
        # each copy of a 4 MiB listing cost ~4 ms (fresh pages) on the test host.
        shown[0] = b"[" + shown[0]
        shown[-1] = shown[-1] + b"]"
        return b",".join(shown)
