"""Acquires waiting for capacity (`wait_seconds`), first come first served.

No polling: a waiter sleeps until capacity is freed (a release, an expiry, a failed
provision). A freed slot wakes the waiter at the head; a waiter that still finds nothing
passes the wake on to the one behind it, so a slot that suits only a later waiter (another
kind or GPU class) still reaches it, and every freed slot is offered in arrival order.

Once the scheduler drains (SIGTERM), the line is closed: nobody joins, and every waiter
is woken at once to leave with ShuttingDown (503 `shutting_down`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from openalice_scheduler.errors import NoProviderAvailable, ShuttingDown
from openalice_scheduler.metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_RETRY_AFTER_S = 300


@dataclass(eq=False)
class Waiter:
    kind: str
    gpu: str
    since: float = field(default_factory=time.monotonic)
    woken: asyncio.Event = field(default_factory=asyncio.Event)


class CapacityQueue:
    def __init__(self, metrics: Metrics) -> None:
        self._queue: deque[Waiter] = deque()
        self._metrics = metrics
        self.closed = False

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        """A woken waiter is retrying now: a newcomer must queue behind it, not overtake."""
        return any(w.woken.is_set() for w in self._queue)

    async def serve(
        self,
        attempt: Callable[[], Awaitable[T]],
        wait_seconds: float,
        gone: asyncio.Event | None,
        *,
        kind: str,
        gpu: str,
    ) -> T:
        """`attempt()`, tried again each time capacity is freed while it finds every
        provider at capacity, for up to `wait_seconds`, in arrival order. Raises the
        last NoProviderAvailable when time is up, the refusal was not for capacity, or
        the caller is `gone`; ShuttingDown once the line is closed."""
        if self.closed:
            raise ShuttingDown()
        deadline = time.monotonic() + wait_seconds
        waiter: Waiter | None = None
        served = False
        try:
            # Behind others already waiting: queue up rather than overtake them.
            if wait_seconds and self.busy:
                waiter = self.join(kind, gpu)
                await self.wait(waiter, deadline - time.monotonic(), gone)
            while True:
                if self.closed:
                    raise ShuttingDown()
                try:
                    result = await attempt()
                    served = True
                    return result
                except NoProviderAvailable as exc:
                    remaining = deadline - time.monotonic()
                    if not exc.at_capacity or remaining <= 0 or _left(gone):
                        if exc.at_capacity:
                            self._metrics.refused_at_capacity(kind, gpu)
                        raise
                    if self.closed:
                        raise ShuttingDown() from None
                    if waiter is None:
                        waiter = self.join(kind, gpu)
                    else:
                        self.pass_on(waiter)
                    log.info(
                        "acquire (%s, gpu=%s) waits up to %.0f s for capacity", kind, gpu, remaining
                    )
                    await self.wait(waiter, remaining, gone)
                    if _left(gone):
                        raise
        finally:
            if waiter is not None:
                self.leave(waiter, _outcome(served, gone, deadline))

    def join(self, kind: str, gpu: str) -> Waiter:
        waiter = Waiter(kind, gpu)
        self._queue.append(waiter)
        self._metrics.wait_began(kind, gpu)
        return waiter

    def leave(self, waiter: Waiter, outcome: str) -> None:
        """Leave the queue (`outcome`: metrics.WAIT_OUTCOMES). A waiter that was woken and
        did not use the slot passes the wake on."""
        if outcome != "served" and waiter.woken.is_set():
            self.pass_on(waiter)
        with contextlib.suppress(ValueError):
            self._queue.remove(waiter)
        self._metrics.wait_ended(waiter.kind, waiter.gpu, outcome, time.monotonic() - waiter.since)

    def close(self) -> None:
        """The scheduler drains: every waiter wakes now and leaves with ShuttingDown, and
        so does every acquire that would have joined."""
        self.closed = True
        for waiter in self._queue:
            waiter.woken.set()

    def freed(self) -> None:
        """Capacity was freed: wake the first waiter not already retrying."""
        for waiter in self._queue:
            if not waiter.woken.is_set():
                waiter.woken.set()
                return

    def pass_on(self, waiter: Waiter) -> None:
        """`waiter` was woken but found nothing: it sleeps again and the next one tries."""
        waiter.woken.clear()
        behind = False
        for other in self._queue:
            if other is waiter:
                behind = True
            elif behind and not other.woken.is_set():
                other.woken.set()
                return

    async def wait(self, waiter: Waiter, timeout: float, gone: asyncio.Event | None) -> bool:
        """Sleep until woken (True), or until `timeout` or the caller is gone (False)."""
        woken = asyncio.ensure_future(waiter.woken.wait())
        waits: set[asyncio.Future[object]] = {woken}  # type: ignore[arg-type]
        if gone is not None:
            waits.add(asyncio.ensure_future(gone.wait()))
        try:
            await asyncio.wait(
                waits, timeout=max(timeout, 0.0), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for future in waits:
                future.cancel()
        return waiter.woken.is_set() and not (gone is not None and gone.is_set())


def retry_after(due_us: int | None, now_us: int) -> int:
    """Seconds a caller refused for capacity should wait before retrying: until the next
    lease is due to end (`due_us`), 1 to 300 s; 5 s when none is due."""
    if due_us is None:
        return 5
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil((due_us - now_us) / 1e6)))


def _left(gone: asyncio.Event | None) -> bool:
    return gone is not None and gone.is_set()


def _outcome(served: bool, gone: asyncio.Event | None, deadline: float) -> str:
    if served:
        return "served"
    if _left(gone):
        return "gone"
    return "timeout" if time.monotonic() >= deadline else "refused"
