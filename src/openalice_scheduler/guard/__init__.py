"""The guard (`openalice-scheduler guard`; docs/concepts/guard.md#the-guard): a small process of its
own, deployed apart from the scheduler, that destroys the workers of one
SCHEDULER_INSTANCE once no scheduler has answered it for GUARD_SILENCE_SECONDS and
their lease (as last learned) ended GUARD_GRACE_SECONDS ago. It watches through the
providers' own APIs, with the scheduler's provider configuration (PROVIDERS,
DOCKER_HOST, RUNPOD_*), and learns each lease's end from the scheduler (`GET
/v1/guard`), keeping it in GUARD_STATE_FILE."""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path

from openalice_scheduler.config import Settings
from openalice_scheduler.errors import StartupError
from openalice_scheduler.guard.watch import Guard
from openalice_scheduler.logs import configure_logging
from openalice_scheduler.providers import InstantProvider, ProviderConfigError, build_providers

__all__ = ["Guard", "run"]


def run(settings: Settings) -> None:
    """Run a guard until SIGTERM/SIGINT. Raises StartupError (one line) when it cannot."""
    configure_logging(settings.log_filter, settings.secrets(), settings.log_format)
    if not settings.guard_scheduler_url:
        raise StartupError(
            "invalid configuration: GUARD_SCHEDULER_URL must be set for "
            "the guard: the scheduler replicas it polls"
        )
    try:
        providers = [
            p for p in build_providers(settings) if not isinstance(p, InstantProvider)
        ]  # static: nothing to destroy
    except (ProviderConfigError, ValueError) as exc:
        raise StartupError(f"invalid configuration: {exc}") from None
    if not providers:
        raise StartupError(
            "invalid configuration: PROVIDERS names no provider whose "
            "workers the guard could destroy (local-docker, runpod, modal, kubernetes)"
        )
    state_file = Path(settings.guard_state_file)
    try:
        guard = Guard(
            guard_id=settings.guard_id or socket.gethostname(),
            urls=settings.guard_scheduler_url.split(","),
            secret=settings.internal_secret.get_secret_value(),
            providers=providers,
            state_file=state_file,
            poll=settings.guard_poll_seconds,
            silence=settings.guard_silence_seconds,
            grace=settings.guard_grace_seconds,
        )
    except (OSError, ValueError, TypeError) as exc:
        raise StartupError(
            f"GUARD_STATE_FILE {state_file} cannot be read: {type(exc).__name__}"
        ) from None
    asyncio.run(_serve(guard))


async def _serve(guard: Guard) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await guard.run(stop)
    finally:
        await guard.close()
