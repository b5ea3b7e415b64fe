"""The sweeper: wakes at the next known expiry or release retry (or each interval) and
hands the service what is due."""

from __future__ import annotations

import asyncio
import math

from opentelemetry.trace import Tracer

from openalice_scheduler.lifecycle import Clock, LeaseService
from openalice_scheduler.loops.base import LoopService
from openalice_scheduler.times import to_us


class Alarm:
    """When the sweeper should next look: told of every moment something becomes due
    (`due`, the service's `on_due`), it wakes the sweeper when that comes before the
    sweeper's next pass."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.event = asyncio.Event()
        self.wake_at = math.inf  # monotonic time the sweeper will next wake

    def due(self, at_us: int) -> None:
        if self.clock.monotonic() + (at_us - to_us(self.clock.now())) / 1e6 < self.wake_at:
            self.event.set()


class Sweeper(LoopService):
    """Has the service release expired leases and retry failed releases. Wakes at the
    next known expiry or retry, so expiry never waits for a whole interval."""

    name = "sweeper"

    def __init__(
        self, service: LeaseService, alarm: Alarm, tracer: Tracer, interval: float
    ) -> None:
        super().__init__(interval, wake=alarm.event)
        self.service = service
        self.alarm = alarm
        self.tracer = tracer

    async def run_once(self) -> int:
        with self.tracer.start_as_current_span("sweep") as span:
            released = await self.service.release_due()
            span.set_attribute("leases", released)
        self.service.metrics.sweep_last_success.set_to_current_time()
        return released

    async def next_wait(self) -> float:
        # While the next due time is being read, any `due` must wake the loop: a lease
        # activated after the read but before `wake_at` is set below was otherwise
        # compared with the stale (past) `wake_at`, ignored, and left to wait a whole
        # interval past its expiry.
        self.alarm.wake_at = math.inf
        due = await self.service.store.next_due()
        wait = self.interval
        if due is not None:
            wait = min(wait, max(0.0, (due - self.service.now_us()) / 1e6))
        self.alarm.wake_at = self.alarm.clock.monotonic() + wait
        return wait
