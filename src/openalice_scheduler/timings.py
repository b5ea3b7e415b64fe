"""How long a request waited on its worker (its hand-off, or its making and probing),
told to the caller as `Server-Timing: worker;desc="warm"|"cold";dur=<ms>`
(docs/concepts/pools.md#reading-the-hand-off-time): what remains of the request's time
is the scheduler's own.

The acquire route opens a tally for its request (`collect`); the core adds each wait on
a worker to it (`on_worker`), in the same task (a context variable), so no call passes it
along."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass
class Tally:
    worker_s: float = 0.0
    # How its worker came: "warm" (a pool's, handed off) or "cold" (made for it).
    how: str | None = None

    def header(self) -> str:
        desc = f';desc="{self.how}"' if self.how else ""
        return f"worker{desc};dur={self.worker_s * 1000:.2f}"


_current: ContextVar[Tally | None] = ContextVar("openalice_timings", default=None)


@contextmanager
def collect() -> Iterator[Tally]:
    """A tally for what runs inside the block, in this task."""
    tally = Tally()
    token = _current.set(tally)
    try:
        yield tally
    finally:
        _current.reset(token)


@contextmanager
def on_worker(how: str) -> Iterator[None]:
    """Time spent inside the block is the worker's, which comes `how` ("warm", "cold"),
    in the current tally (if any)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        tally = _current.get()
        if tally is not None:
            tally.worker_s += time.perf_counter() - started
            tally.how = how
