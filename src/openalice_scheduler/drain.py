"""SIGTERM, drained: the process stops taking work, lets what is under way finish and
answers it, and only then exits.

uvicorn alone, on SIGTERM, stops listening at once and gives requests under way its
graceful timeout before cancelling them: a caller waiting in line for capacity would be
cut off, and a provision past that timeout too. So the signals are the drain's from the
moment the app has started. uvicorn takes SIGTERM and SIGINT when its `serve()` begins,
before the app's lifespan starts; the lifespan's `startup.complete` is where the drain
takes them back (`loop.add_signal_handler`). Then:

1. SIGTERM: the service drains (`LeaseService.drain`): every acquire, and every caller
   waiting in line, is answered 503 `shutting_down` with `Retry-After`; `/readyz` says
   503. The listener stays open, so a balancer's probe reads that 503 and a caller gets
   an answer it can retry rather than a refused connection; every answer from now on
   closes its connection, so a retry goes out on a new one, which the balancer can send
   to a replica that is ready.
2. Once no request is under way, or SHUTDOWN_GRACE_SECONDS have passed, uvicorn is told
   to exit (`Server.should_exit`): it stops listening, closes idle connections, runs the
   lifespan's shutdown, and the process exits 0. A request still under way after the
   grace (a provision that takes longer) is cut off here and answered 503
   `shutting_down` (never uvicorn's plain 500); a lease it left `provisioning` is
   resolved by reconciliation, as after a crash.
3. A second SIGTERM or SIGINT ends the grace at once; after it, each of them has the
   operating system's default action (the process dies at once, like kill -9).

One limit: a blocking Docker call under way runs on in its thread, which the process
waits for before it exits (each call is bounded by the Docker client's timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openalice_scheduler.api.errors import error_response
from openalice_scheduler.errors import ShuttingDown

log = logging.getLogger(__name__)

# Time for the answers still being written once the drain is over (uvicorn's graceful
# timeout), and for the requests cut off after the grace to be answered.
FLUSH_S = 2
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Drain:
    """The app as uvicorn serves it: counts the requests under way, closes each
    connection after its answer once draining, and runs the drain on SIGTERM.
    `on_drain` is called once, when the drain begins."""

    def __init__(self, app: ASGIApp, grace: float, on_drain: Callable[[], None]) -> None:
        self.app = app
        self.grace = grace
        self.on_drain = on_drain
        self.draining = False
        self._server: uvicorn.Server | None = None
        self._under_way: set[asyncio.Task[object]] = set()
        self._cut: set[asyncio.Task[object]] = set()  # cut off by the drain
        self._idle = asyncio.Event()
        self._idle.set()
        self._signals = 0
        self._task: asyncio.Task[None] | None = None

    def run(self, server: uvicorn.Server) -> None:
        """Serve until drained (or stopped at once by a second signal)."""
        self._server = server
        server.run()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._request(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self.app(scope, receive, self._watch_startup(send))
        else:
            await self.app(scope, receive, send)

    # --- the drain -------------------------------------------------------------------

    def _take_signals(self) -> None:
        # Signal handlers belong to the main thread (uvicorn takes none elsewhere either).
        if threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._signalled, sig)

    def _signalled(self, sig: int) -> None:
        self._signals += 1
        name = signal.Signals(sig).name
        if self._signals == 1:
            log.info("%s: draining; requests under way have up to %g s to finish", name, self.grace)
            self.draining = True
            self.on_drain()
            self._task = asyncio.create_task(self._drain(), name="drain")
            return
        log.warning("%s again: exiting without waiting for requests under way", name)
        loop = asyncio.get_running_loop()
        for other in SIGNALS:
            loop.remove_signal_handler(other)
            # The operating system's default, also for SIGINT (Python's would raise
            # KeyboardInterrupt wherever the shutdown happens to be): the process dies.
            signal.signal(other, signal.SIG_DFL)
        if self._task is not None:
            self._task.cancel()
        self._cut_off()
        self._exit()

    async def _drain(self) -> None:
        started = time.monotonic()
        if not await _within(self._idle, self.grace):
            log.warning(
                "%d request(s) still under way after the %g s grace: answered 503 "
                "(a lease left provisioning is resolved by reconciliation)",
                len(self._under_way),
                self.grace,
            )
            self._cut_off()
            await _within(self._idle, FLUSH_S)
        else:
            log.info("drained in %.1f s; exiting", time.monotonic() - started)
        self._exit()

    def _cut_off(self) -> None:
        for task in self._under_way - self._cut:
            self._cut.add(task)
            task.cancel()

    def _exit(self) -> None:
        if self._server is not None:
            self._server.should_exit = True

    # --- ASGI ------------------------------------------------------------------------

    def _watch_startup(self, send: Send) -> Send:
        async def forward(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                self._take_signals()
            await send(message)

        return forward

    async def _request(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        started = False

        async def forward(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if self.draining:
                    message = _closing(message)
            await send(message)

        self._under_way.add(task)
        self._idle.clear()
        try:
            await self.app(scope, receive, forward)
        except asyncio.CancelledError:
            # Cut off by the drain, and by nobody else (uvicorn cancels too): answered.
            if task not in self._cut or task.cancelling() > 1:
                raise
            task.uncancel()
            if not started:
                error = ShuttingDown(
                    "the scheduler shut down before this request finished; "
                    "retry, another replica answers"
                )
                await error_response(error)(scope, receive, forward)
        finally:
            self._under_way.discard(task)
            self._cut.discard(task)
            if not self._under_way:
                self._idle.set()


def _closing(start: Message) -> Message:
    """The answer's start with `Connection: close`: the caller's next request goes out on
    a new connection, which the balancer can send to a replica that is ready."""
    headers = list(start.get("headers", []))
    if not any(key.lower() == b"connection" for key, _ in headers):
        headers.append((b"connection", b"close"))
    return {**start, "headers": headers}


async def _within(event: asyncio.Event, timeout: float) -> bool:
    """Whether `event` is set within `timeout` seconds."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)
    return event.is_set()
