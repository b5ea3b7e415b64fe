"""What a guard knows, kept on its own disk (GUARD_STATE_FILE) so that a guard killed and
started again in the middle of a silence goes on from where it was: the same silence,
the same deadlines, never a fresh start that forgets a worker's lease."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any


@dataclass
class Memory:
    # Wall-clock seconds (time.time()): they must mean the same after a restart.
    started_at: float
    # The last time a scheduler answered the guard's poll; None: never yet.
    last_contact: float | None = None
    store_id: str | None = None
    instance: str | None = None
    max_ttl_seconds: float | None = None
    # Lease id → until when its worker may run, on this guard's clock, as last learned.
    until: dict[str, float] = field(default_factory=dict)
    # Lease id of each worker the provider listed → when this guard first saw it.
    first_seen: dict[str, float] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path, now: float) -> Memory:
        """What was kept at `path`, or a fresh memory when there is none yet. A file that
        cannot be read is an error: starting afresh would forget every deadline."""
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return cls(started_at=now)
        return cls(**data)

    def save(self, path: Path) -> None:
        """Written whole, then renamed over the old file (and fsync'd): a guard killed
        mid-write leaves the previous memory, never half of one."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(asdict(self), out, separators=(",", ":"))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def learn(self, answer: dict[str, Any], now: float) -> None:
        """A scheduler's answer to the poll (`GET /v1/guard`). Its times are moved onto
        this guard's clock (by the scheduler's `now`), so clocks that disagree do not
        shorten a lease. A lease known before and missing now has ended: its worker may
        run no longer than now."""
        offset = now - _seconds(answer["now"])
        live = {w["lease_id"]: _seconds(w["until"]) + offset for w in answer["workers"]}
        for lease_id, until in self.until.items():
            if lease_id not in live:
                self.until[lease_id] = min(until, now)
        self.until.update(live)
        self.last_contact = now
        self.store_id = answer["store_id"]
        self.instance = answer["instance"]
        self.max_ttl_seconds = float(answer["max_ttl_seconds"])

    def saw(self, listed: set[str], now: float, *, complete: bool) -> None:
        """The workers the providers list now. With `complete` (every provider answered),
        what is no longer listed and no longer live is forgotten."""
        for lease_id in listed:
            self.first_seen.setdefault(lease_id, now)
        if complete:
            self.first_seen = {k: v for k, v in self.first_seen.items() if k in listed}
            self.until = {k: v for k, v in self.until.items() if k in listed or v > now}

    def silent_for(self, now: float) -> float:
        """Seconds since a scheduler last answered (since this guard first started, when
        none ever has)."""
        return now - (self.last_contact if self.last_contact is not None else self.started_at)

    def deadline(self, lease_id: str, *, grace: float, default_max_ttl: float) -> float:
        """When a worker of `lease_id` is to be destroyed during a silence: its lease's
        last known end plus the grace; for a worker never seen in a lease, the longest
        TTL plus the grace after this guard first saw it (it cannot be older than that
        and still be held)."""
        if lease_id in self.until:
            return self.until[lease_id] + grace
        max_ttl = self.max_ttl_seconds or default_max_ttl
        return self.first_seen[lease_id] + max_ttl + grace


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
