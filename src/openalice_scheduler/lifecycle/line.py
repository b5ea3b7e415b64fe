"""The callers waiting for capacity, and the line's one order
(docs/concepts/priorities.md#the-admission-loop).

A caller that finds no room (or finds others already waiting) joins the line: its row
in the store's `waiters`, and here, on its replica, a `Waiter` that sleeps until the
admission loop (admitting.py, on one replica) decides on it. No caller decides its own
admission; it only waits for the decision, its wait to run out, or its caller to hang up.

The order (`order`) is the same everywhere it is shown or used: by class, then by
arrival; every full LINE_AGING_SECONDS a caller has waited lifts it one class up the
list of classes (never above the highest), so a low class is not starved forever. A
retry of the same request (owner and correlation id) within ten minutes keeps its first
arrival (store/waiters.py).

The line is bounded per replica: MAX_WAITING_CALLERS, and per owner its share
(MAX_WAITING_PER_OWNER). A full line makes room for a caller of a higher class by
answering its lowest, newest waiter 503 `line_full`; otherwise the newcomer is answered
so. Once the scheduler drains (SIGTERM), the line is closed: nobody joins, and every
waiter leaves with ShuttingDown."""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from openalice_scheduler.errors import LineFull
from openalice_scheduler.lifecycle.clock import SYSTEM_CLOCK, Clock
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.store.waiters import Decision, WaitingRow

MAX_RETRY_AFTER_S = 300
# A replica silent this long (its heartbeat, each second) takes its callers in line with it.
LINE_TIMEOUT_S = 4.0
# Admissions counted over this window make the line's pace (Retry-After).
PACE_WINDOW_S = 60.0


@dataclass(eq=False)
class Waiter:
    """A caller in line on this replica: its row as the store keeps it, and how it is
    woken (`decided`: the loop wrote a decision, or it was pushed out)."""

    row: WaitingRow
    since: float = 0.0  # when it joined (the line's clock, monotonic seconds)
    decided: asyncio.Event = field(default_factory=asyncio.Event)
    decision: Decision | None = None
    # Pushed out of a full line by a caller of a higher class: its LineFull.
    pushed_out: LineFull | None = None

    @property
    def waiter_id(self) -> str:
        return self.row.waiter_id


def new_waiter_id() -> str:
    return str(uuid.uuid4())


class Line:
    """This replica's callers in line."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        most: int = 1000,
        per_owner: int = 500,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.waiters: dict[str, Waiter] = {}
        self.clock = clock
        self._metrics = metrics
        self.most = most
        self.per_owner = per_owner
        self.closed = False
        self._admitted: deque[float] = deque()  # when callers here were served

    def __len__(self) -> int:
        return len(self.waiters)

    def make_room(self, row: WaitingRow) -> Waiter | None:
        """Room for `row` in this replica's line: None when there is, else the waiter
        to push out for it (the lowest, newest of a lower class); LineFull when none
        may be."""
        if len(self.waiters) >= self.most:
            lowest = min(
                (w for w in self.waiters.values() if w.row.priority < row.priority),
                key=lambda w: (w.row.priority, -w.row.arrived_at),
                default=None,
            )
            if lowest is None:
                raise LineFull(
                    f"{len(self.waiters)} callers wait in line here already "
                    f"(MAX_WAITING_CALLERS = {self.most}); try again later",
                    limit=self.most,
                )
            return lowest
        if row.owner_id is not None:
            mine = sum(1 for w in self.waiters.values() if w.row.owner_id == row.owner_id)
            if mine >= self.per_owner:
                raise LineFull(
                    f"owner {row.owner_id!r} has {mine} callers waiting in line here already "
                    f"(MAX_WAITING_PER_OWNER = {self.per_owner}); try again later",
                    limit=self.per_owner,
                )
        return None

    def push_out(self, waiter: Waiter, error: LineFull) -> None:
        waiter.pushed_out = error
        waiter.decided.set()

    def add(self, waiter: Waiter) -> None:
        waiter.since = self.clock.monotonic()
        self.waiters[waiter.waiter_id] = waiter
        row = waiter.row
        self._metrics.wait_began(row.kind, row.gpu, row.priority_class)

    def remove(self, waiter: Waiter, outcome: str) -> None:
        """Out of this replica's line (`outcome`: metrics.WAIT_OUTCOMES)."""
        if self.waiters.pop(waiter.waiter_id, None) is None:
            return
        row = waiter.row
        now = self.clock.monotonic()
        self._metrics.wait_ended(row.kind, row.gpu, row.priority_class, outcome, now - waiter.since)
        if outcome == "served":
            self._admitted.append(now)

    def dispatch(self, decisions: Iterable[Decision]) -> None:
        """Wake the callers here that the loop decided on."""
        for decision in decisions:
            waiter = self.waiters.get(decision.waiter_id)
            if waiter is not None and not waiter.decided.is_set():
                waiter.decision = decision
                waiter.decided.set()

    def close(self) -> None:
        """The scheduler drains: every waiter wakes now and leaves with ShuttingDown,
        and so does every acquire that would have joined."""
        self.closed = True
        for waiter in self.waiters.values():
            waiter.decided.set()

    async def wait(self, waiter: Waiter, timeout: float, gone: asyncio.Event | None) -> None:
        """Sleep until decided (or pushed out, or the line closed), the caller `gone`,
        or `timeout`."""
        waits: set[asyncio.Future[object]] = {asyncio.ensure_future(waiter.decided.wait())}
        if gone is not None:
            waits.add(asyncio.ensure_future(gone.wait()))
        try:
            await asyncio.wait(
                waits, timeout=max(timeout, 0.0), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for future in waits:
                future.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await future

    def pace(self) -> float:
        """Callers served per second here over the last minute (0 when none)."""
        now = self.clock.monotonic()
        while self._admitted and self._admitted[0] < now - PACE_WINDOW_S:
            self._admitted.popleft()
        return len(self._admitted) / PACE_WINDOW_S


def order(
    rows: Sequence[WaitingRow], ranks: Sequence[str], now_us: int, aging_us: int
) -> list[WaitingRow]:
    """The line in admission order: by class (`ranks`, lowest first), each caller lifted
    one class per full `aging_us` waited, never above the highest; then by arrival."""
    where = {name: i for i, name in enumerate(ranks)}
    top = len(ranks) - 1

    def key(row: WaitingRow) -> tuple[int, int, str]:
        waited = max(0, now_us - row.arrived_at)
        rank = min(top, where.get(row.priority_class, 0) + waited // max(aging_us, 1))
        return (-rank, row.arrived_at, row.waiter_id)

    return sorted(rows, key=key)


def retry_after(position: int | None, pace: float, due_us: int | None, now_us: int) -> int:
    """Seconds a caller refused for capacity should wait before retrying, 1 to 300: with
    callers ahead of it (`position`, from 1) and the line moving (`pace` per second),
    until the line has come to it; else until the next lease is due to end (`due_us`);
    5 s when none is due."""
    if position is not None and pace > 0:
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(position / pace)))
    if due_us is None:
        return 5
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil((due_us - now_us) / 1e6)))
