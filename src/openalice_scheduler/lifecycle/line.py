"""Acquires waiting for capacity (`wait_seconds`): in order of priority, then arrival.

No polling: a waiter sleeps until capacity is freed (a release, an expiry, a failed
provision, here or on another replica). A freed slot wakes the first waiter of this
replica's line; a waiter that still finds nothing passes the wake on to the one behind
it, so a slot that suits only a later waiter (another kind or GPU class) still reaches
it. The order across replicas is the admission's (admission.py): each waiter is also a
row of the store's `waiters`, and a reservation is refused while a caller ahead of it,
on any replica, could be served by the same capacity.

The line is bounded: MAX_WAITING_CALLERS per replica, and per owner its share
(MAX_WAITING_PER_OWNER); the next caller is answered 503 `line_full` at once. Once the
scheduler drains (SIGTERM), the line is closed: nobody joins, and every waiter is woken
at once to leave with ShuttingDown (503 `shutting_down`)."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from openalice_scheduler.errors import LineFull, NoProviderAvailable, ShuttingDown
from openalice_scheduler.lifecycle.clock import SYSTEM_CLOCK, Clock
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.store.waiters import WaitingRow

# The waiting line's lines, as ever (operators filter by logger name).
log = logging.getLogger("openalice_scheduler.waiting")
T = TypeVar("T")
MAX_RETRY_AFTER_S = 300
_ARRIVALS = itertools.count()


@dataclass(eq=False)
class Waiter:
    """A caller asking for capacity: where it stands in the line (`priority`, then
    `arrived_at`, µs on the scheduler's clock), and whether it waits there yet."""

    kind: str
    gpu: str
    priority: int = 0
    priority_class: str = "default"
    owner: str | None = None
    correlation: str | None = None
    region: str | None = None
    arrived_at: int = 0
    # When its wait ends (µs), and the providers that could serve it (set by its last
    # attempt): what the other replicas see of it.
    until: int = 0
    providers: tuple[str, ...] = ()
    # The lease preempted for it (one victim per caller), whose capacity is its own.
    claims: str | None = None
    waiter_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    since: float = 0.0  # when it began to ask (the line's clock, monotonic seconds)
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: bool = False
    # Ties of priority and arrival keep the order the callers came in, here.
    _seq: int = field(default_factory=lambda: next(_ARRIVALS))

    @property
    def rank(self) -> tuple[int, int, int]:
        return (-self.priority, self.arrived_at, self._seq)

    def row(self) -> WaitingRow:
        """This caller as the other replicas see it in the line (the store's
        `waiters`)."""
        return WaitingRow(
            waiter_id=self.waiter_id,
            priority=self.priority,
            arrived_at=self.arrived_at,
            kind=self.kind,
            gpu=self.gpu,
            region=self.region,
            owner_id=self.owner,
            correlation_id=self.correlation,
            priority_class=self.priority_class,
            providers=self.providers,
            until=self.until,
        )


class CapacityQueue:
    def __init__(
        self,
        metrics: Metrics,
        *,
        most: int = 1000,
        per_owner: int = 500,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._queue: list[Waiter] = []  # in rank order
        self.clock = clock
        self._metrics = metrics
        self.most = most
        self.per_owner = per_owner
        self.closed = False
        # Told when a waiter joins and leaves (the store's `waiters`, acquiring.py).
        self.on_join: Callable[[Waiter], Awaitable[None]] | None = None
        self.on_leave: Callable[[Waiter, str], Awaitable[None]] | None = None

    def __len__(self) -> int:
        return len(self._queue)

    def busy(self, priority: int) -> bool:
        """A woken waiter of this priority or higher is retrying now: a newcomer must
        queue behind it, not overtake it."""
        return any(w.woken.is_set() and w.priority >= priority for w in self._queue)

    async def serve(
        self,
        attempt: Callable[[Waiter], Awaitable[T]],
        wait_seconds: float,
        gone: asyncio.Event | None,
        caller: Waiter,
    ) -> T:
        """`attempt(caller)`, tried again each time capacity is freed while it finds every
        provider at capacity, for up to `wait_seconds`, in the line's order. Raises the
        last NoProviderAvailable when time is up, the refusal was not for capacity, or
        the caller is `gone`; LineFull when the line has no room for it; ShuttingDown
        once the line is closed."""
        if self.closed:
            raise ShuttingDown()
        caller.since = self.clock.monotonic()
        deadline = caller.since + wait_seconds
        served = False
        try:
            # Behind others already waiting: queue up rather than overtake them.
            if wait_seconds and self.busy(caller.priority):
                await self.join(caller)
                await self.wait(caller, deadline - self.clock.monotonic(), gone)
            while True:
                if self.closed:
                    raise ShuttingDown()
                try:
                    result = await attempt(caller)
                    served = True
                    return result
                except NoProviderAvailable as exc:
                    remaining = deadline - self.clock.monotonic()
                    if not exc.at_capacity or remaining <= 0 or _left(gone):
                        if exc.at_capacity:
                            self._metrics.refused_at_capacity(caller.kind, caller.gpu)
                        raise
                    if self.closed:
                        raise ShuttingDown() from None
                    if not caller.waiting:
                        await self.join(caller)
                    else:
                        self.pass_on(caller)
                    log.info(
                        "acquire (%s, gpu=%s, class %s) waits up to %.0f s for capacity",
                        caller.kind,
                        caller.gpu,
                        caller.priority_class,
                        remaining,
                    )
                    await self.wait(caller, remaining, gone)
                    if _left(gone):
                        raise
        finally:
            if caller.waiting:
                late = self.clock.monotonic() >= deadline
                await self.leave(caller, _outcome(served, gone, late))

    async def join(self, waiter: Waiter) -> None:
        """Into the line, at its rank; LineFull when the line, or the owner's share of
        it, is full."""
        if len(self._queue) >= self.most:
            raise LineFull(
                f"{len(self._queue)} callers wait in line here already "
                f"(MAX_WAITING_CALLERS = {self.most}); try again later",
                limit=self.most,
            )
        if waiter.owner is not None:
            mine = sum(1 for w in self._queue if w.owner == waiter.owner)
            if mine >= self.per_owner:
                raise LineFull(
                    f"owner {waiter.owner!r} has {mine} callers waiting in line here already "
                    f"(MAX_WAITING_PER_OWNER = {self.per_owner}); try again later",
                    limit=self.per_owner,
                )
        bisect.insort(self._queue, waiter, key=lambda w: w.rank)
        waiter.waiting = True
        self._metrics.wait_began(waiter.kind, waiter.gpu, waiter.priority_class)
        if self.on_join is not None:
            await self.on_join(waiter)

    async def leave(self, waiter: Waiter, outcome: str) -> None:
        """Leave the line (`outcome`: metrics.WAIT_OUTCOMES). A waiter that was woken and
        did not use the slot passes the wake on."""
        if outcome != "served" and waiter.woken.is_set():
            self.pass_on(waiter)
        with contextlib.suppress(ValueError):
            self._queue.remove(waiter)
        waiter.waiting = False
        self._metrics.wait_ended(
            waiter.kind,
            waiter.gpu,
            waiter.priority_class,
            outcome,
            self.clock.monotonic() - waiter.since,
        )
        if self.on_leave is not None:
            await self.on_leave(waiter, outcome)

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


def _outcome(served: bool, gone: asyncio.Event | None, late: bool) -> str:
    if served:
        return "served"
    if _left(gone):
        return "gone"
    return "timeout" if late else "refused"
