"""The one source of time of a lease's life, the loops, the pool and the line: every
rule about time (an expiry, a grace, a backoff, a wait in line, a pass's interval) reads
it from the Clock it is given, never from the machine directly, so that tests move one
instead of sleeping."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Protocol


class Clock(Protocol):
    """`now()`: wall time, for what is stored and shown (expiries, grants, preemptions);
    `monotonic()`: seconds that only go forward, for intervals, backoffs and deadlines."""

    def now(self) -> datetime: ...

    def monotonic(self) -> float: ...


class SystemClock:
    """The machine's clocks."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM_CLOCK = SystemClock()
