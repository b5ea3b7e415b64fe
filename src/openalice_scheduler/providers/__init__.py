"""Providers by name. `build_providers` turns PROVIDERS into instances, in order."""

from __future__ import annotations

import logging
from collections.abc import Callable

from openalice_scheduler.config import Settings
from openalice_scheduler.providers.base import (
    Availability,
    InstantProvider,
    Provider,
    ProviderStatus,
    Worker,
    WorkerInfo,
    WorkerSpec,
)

log = logging.getLogger(__name__)


class ProviderConfigError(ValueError):
    """PROVIDERS cannot be turned into a usable list; the message says why."""


class ProviderSkipped(Exception):
    """A listed provider is not configured enough to use (e.g. no API key); the message
    says why. build_providers warns and goes on, or, when nothing is left, puts the
    reason into its one-line error (a warning logged first would make start-up failure
    print two lines)."""


def _local_docker(settings: Settings) -> Provider:
    from openalice_scheduler.providers.docker import LocalDockerProvider

    return LocalDockerProvider(settings)


def _runpod(settings: Settings) -> Provider | None:
    if settings.runpod_api_key is None or not settings.runpod_api_key.get_secret_value():
        raise ProviderSkipped("RUNPOD_API_KEY is not set")
    from openalice_scheduler.providers.runpod import RunPodProvider

    return RunPodProvider(settings)


def _static(settings: Settings) -> Provider:
    from openalice_scheduler.providers.static import StaticProvider

    if not settings.static_workers:
        raise ProviderConfigError("PROVIDERS lists static but STATIC_WORKERS is not set")
    try:
        return StaticProvider(settings.static_workers, settings.static_region)
    except ValueError as exc:
        raise ProviderConfigError(str(exc)) from None


REGISTRY: dict[str, Callable[[Settings], Provider | None]] = {
    "local-docker": _local_docker,
    "runpod": _runpod,
    "static": _static,
}


def build_providers(settings: Settings) -> list[Provider]:
    names = settings.provider_names
    unknown = [name for name in names if name not in REGISTRY]
    if unknown:
        raise ProviderConfigError(
            f"PROVIDERS: unknown provider {unknown[0]!r}; valid names: {', '.join(REGISTRY)}"
        )
    if len(set(names)) != len(names):
        raise ProviderConfigError("PROVIDERS: a provider is listed twice")
    built: list[Provider] = []
    skipped: list[str] = []
    for name in names:
        try:
            provider = REGISTRY[name](settings)
        except ProviderSkipped as exc:
            skipped.append(f"{name} skipped: {exc}")
            continue
        if provider is not None:
            built.append(provider)
    if not built:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise ProviderConfigError(f"PROVIDERS: no usable provider in {settings.providers!r}{why}")
    for reason in skipped:
        log.warning("PROVIDERS: %s", reason)
    return built


__all__ = [
    "REGISTRY",
    "Availability",
    "InstantProvider",
    "Provider",
    "ProviderConfigError",
    "ProviderSkipped",
    "ProviderStatus",
    "Worker",
    "WorkerInfo",
    "WorkerSpec",
    "build_providers",
]
