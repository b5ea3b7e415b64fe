"""`serve`: the app under uvicorn, with uvicorn's public settings only.

What uvicorn bounds here, and what it cannot (docs/reference/api.md#http-limits):
- Headers: its h11 protocol buffers at most `MAX_INCOMPLETE_HEADERS` bytes of a request
  that has not finished its headers and then answers 400 (plain text, h11's 431 hint is
  not used) and closes. httptools, the faster parser (HTTP_PARSER=httptools: about half
  the cost per request, bench/README.md), has no such limit, so h11 is the default.
  Headers that do arrive whole are held to 16 KiB by the app (431, JSON), either way.
- Idle kept-alive connections are closed `timeout_keep_alive` seconds after an answer.
- A body that stalls is the app's to cut off (408, api/middleware.py).
- Not possible with a public setting: a connection that never sends a byte, or stops
  halfway through its headers, stays open (uvicorn arms no timer before the first
  answer). Put a proxy with a header timeout in front where that matters.
"""

from __future__ import annotations

import gc
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from openalice_scheduler.config import Settings

# More than the app's own header limit (16 KiB), so whatever h11 lets through whole
# gets the app's 431 answer.
MAX_INCOMPLETE_HEADERS = 64 * 1024
KEEP_ALIVE_S = 5
# The first generation's size before the collector runs (CPython's default: 700).
GC_YOUNG_THRESHOLD = 10_000


def serve(settings: Settings) -> None:
    """Run the service until SIGTERM/SIGINT, then drain it (drain.py). Raises
    StartupError (one line) when it cannot start."""
    # Imported here: the CLI imports this module for every command.
    import uvicorn

    from openalice_scheduler import startup
    from openalice_scheduler.app import create_app
    from openalice_scheduler.drain import FLUSH_S, Drain
    from openalice_scheduler.errors import StartupError
    from openalice_scheduler.logs import configure_logging
    from openalice_scheduler.providers import ProviderConfigError

    configure_logging(settings.log_filter, settings.secrets(), settings.log_format)
    startup.prepare(settings, os.environ)  # warnings, and a database started late
    try:
        application = create_app(settings)
    except (ProviderConfigError, ValueError) as exc:
        raise StartupError(f"invalid configuration: {exc}") from None
    # create_app takes the SQLite file lock itself (before serving), so a second process
    # on the same file fails there: one line, not a traceback.
    tune_gc()
    # SIGTERM drains first (drain.py); uvicorn's graceful timeout is only what is left
    # once the drain is over.
    drain = Drain(
        application,
        settings.shutdown_grace_seconds,
        on_drain=lambda: application.state.service.drain(),
    )
    config = uvicorn.Config(
        drain,
        host=settings.scheduler_host,
        port=settings.scheduler_port,
        timeout_graceful_shutdown=FLUSH_S,
        **http_options(settings.http_parser),
    )
    drain.run(uvicorn.Server(config))


def http_options(parser: str) -> dict[str, Any]:
    """How uvicorn serves HTTP for the service (bench/floor.py serves with it too)."""
    return {
        "log_config": None,
        "access_log": False,
        # Client addresses are not used: no X-Forwarded-* parsing per request.
        "proxy_headers": False,
        "http": parser,
        "h11_max_incomplete_event_size": MAX_INCOMPLETE_HEADERS,
        "timeout_keep_alive": KEEP_ALIVE_S,
    }


def tune_gc() -> None:
    """Garbage collection for a long-running server, called once the app is built.

    Frozen, the ~120,000 objects that exist by then (modules, classes, the app) live as
    long as the process and are never walked again; every full collection walked them
    all. What a request makes is freed by reference counting, so a larger first
    generation leaves collections rare. Measured at 32 clients on static endpoints:
    collections took ~60 µs of the event loop per lease round trip (~7%), none after."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
