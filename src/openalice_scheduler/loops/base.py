"""Background loops as small services: `run_once()` does one pass (tests call it
directly), `run()` repeats it, `stop()` ends it within a bounded time. A loop finds what
is due or adrift and hands each case to the core (lifecycle/); it holds no rule of a
lease's life itself."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from openalice_scheduler.errors import StoreUnavailable

# The loops' lines, as ever (operators filter by logger name).
log = logging.getLogger("openalice_scheduler.loops")
_MIN_WAIT_S = 0.005


class LoopService:
    name = "loop"

    def __init__(self, interval: float, *, wake: asyncio.Event | None = None) -> None:
        self.interval = interval
        self._wake = wake or asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self.passes = 0  # passes of the loop that finished (readiness.py)

    async def run_once(self) -> object:
        raise NotImplementedError

    async def next_wait(self) -> float:
        return self.interval

    def start(self, *, first_wait: float = 0.0) -> None:
        """Run passes from now on; the first one after `first_wait` seconds (or a wake),
        for a loop whose pass was just run by hand."""
        self._task = asyncio.create_task(self._run(first_wait), name=self.name)

    def wake(self) -> None:
        self._wake.set()

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout)
            except TimeoutError:
                log.warning("%s did not stop within %.0f s; cancelled", self.name, timeout)
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self, first_wait: float) -> None:
        if first_wait > 0:
            await self._sleep(first_wait)
        while not self._stopping:
            try:
                await self.run_once()
                self.passes += 1
                wait = await self.next_wait()
            except StoreUnavailable:
                wait = min(self.interval, 1.0)
            except Exception:
                log.exception("%s pass failed", self.name)
                wait = self.interval
            if self._stopping:
                break
            await self._sleep(wait)

    async def _sleep(self, wait: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), max(wait, _MIN_WAIT_S))
        self._wake.clear()
