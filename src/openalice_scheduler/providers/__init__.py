"""Providers by name. `build_providers` turns PROVIDERS into instances, in order;
`configuration_problems` says beforehand everything that stops it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from openalice_scheduler.config import Settings
from openalice_scheduler.providers.base import (
    Availability,
    BoundedProvider,
    ExplainingProvider,
    InstantProvider,
    PartialListing,
    PlacingProvider,
    Provider,
    ProviderStatus,
    Resync,
    WatchingProvider,
    Worker,
    WorkerDeath,
    WorkerEnded,
    WorkerInfo,
    WorkerSpec,
)

log = logging.getLogger(__name__)


class ProviderConfigError(ValueError):
    """PROVIDERS cannot be turned into a usable list; the message says why."""


def _local_docker(settings: Settings) -> Provider:
    from openalice_scheduler.providers.docker import DockerFleetProvider, LocalDockerProvider
    from openalice_scheduler.providers.docker.hosts import parse_hosts

    if settings.docker_hosts:
        return DockerFleetProvider(settings, parse_hosts(settings.docker_hosts))
    return LocalDockerProvider(settings)


def _runpod(settings: Settings) -> Provider:
    from openalice_scheduler.providers.runpod import RunPodProvider

    return RunPodProvider(settings)


def _modal(settings: Settings) -> Provider:
    from openalice_scheduler.providers.modal import ModalProvider

    return ModalProvider(settings)


def _kubernetes(settings: Settings) -> Provider:
    from openalice_scheduler.providers.kubernetes import KubernetesProvider

    return KubernetesProvider(settings)


def _static(settings: Settings) -> Provider:
    from openalice_scheduler.prices import parse_prices
    from openalice_scheduler.providers.probe import ReadyProbe
    from openalice_scheduler.providers.static import StaticProvider

    assert settings.static_workers, "configuration_problems checked it"
    return StaticProvider(
        settings.static_workers,
        settings.static_region,
        parse_prices(settings.static_price_per_hour),
        checker=ReadyProbe(settings.ready_paths, {})
        if settings.static_probe_interval_seconds
        else None,
        interval=settings.static_probe_interval_seconds,
    )


@dataclass(frozen=True, slots=True)
class Registered:
    """A provider by name: how it is made, and how long a worker it made has to pass the
    scheduler's readiness probe before its lease is answered (providers/probe.py; a
    setting of its own; 0 there: handed out once made). One table, so a provider cannot
    be registered without saying how its workers are probed."""

    make: Callable[[Settings], Provider]
    ready_timeout: Callable[[Settings], float]


REGISTRY: dict[str, Registered] = {
    "local-docker": Registered(_local_docker, lambda s: s.local_docker_ready_timeout_seconds),
    "runpod": Registered(_runpod, lambda s: s.runpod_ready_timeout_seconds),
    # Static workers already run: none is ever made, so none is probed before its
    # hand-out; each is probed in rotation instead (STATIC_PROBE_INTERVAL_SECONDS).
    "static": Registered(_static, lambda s: 0.0),
    "modal": Registered(_modal, lambda s: s.modal_ready_timeout_seconds),
    "kubernetes": Registered(_kubernetes, lambda s: s.k8s_ready_timeout_seconds),
}


def ready_timeouts(settings: Settings) -> dict[str, float]:
    """Per provider name, how long its new worker has to pass the readiness probe."""
    return {name: entry.ready_timeout(settings) for name, entry in REGISTRY.items()}


def configuration_problems(settings: Settings) -> list[str]:
    """Every reason PROVIDERS and its providers' settings cannot be used, one line each,
    found without building a provider (no engine or API is contacted), so that start-up
    reports them all at once with the settings' own errors (startup.py)."""
    names = settings.provider_names
    problems = [
        f"PROVIDERS: unknown provider {name!r}; valid names: {', '.join(REGISTRY)}"
        for name in dict.fromkeys(names)
        if name not in REGISTRY
    ]
    if len(set(names)) != len(names):
        problems.append("PROVIDERS: a provider is listed twice")
    if "static" in names:
        problems += _static_problems(settings)
    if "local-docker" in names and settings.docker_hosts:
        problems += _fleet_problems(settings)
    if "kubernetes" in names:
        problems += _kubernetes_problems(settings)
    skipped = {name: reason for name in names if (reason := _skip_reason(name, settings))}
    if names and not problems and len(skipped) == len(set(names)):
        why = "; ".join(f"{name} skipped: {reason}" for name, reason in skipped.items())
        problems.append(f"PROVIDERS: no usable provider in {settings.providers!r} ({why})")
    return problems


def build_providers(settings: Settings) -> list[Provider]:
    problems = configuration_problems(settings)
    if problems:
        raise ProviderConfigError("; ".join(problems))
    built: list[Provider] = []
    for name in settings.provider_names:
        reason = _skip_reason(name, settings)
        if reason is not None:
            # Only when another provider remains: configuration_problems refuses the rest.
            log.warning("PROVIDERS: %s skipped: %s", name, reason)
            continue
        built.append(REGISTRY[name].make(settings))
    return built


def _skip_reason(name: str, settings: Settings) -> str | None:
    """Why a listed provider is not configured enough to use (it is then skipped with a
    warning, SPEC.md), or None."""
    key = settings.runpod_api_key
    if name == "runpod" and (key is None or not key.get_secret_value()):
        return "RUNPOD_API_KEY is not set"
    secret = settings.modal_token_secret
    if name == "modal" and (
        not settings.modal_token_id or secret is None or not secret.get_secret_value()
    ):
        return "MODAL_TOKEN_ID and MODAL_TOKEN_SECRET are not both set"
    if name == "kubernetes" and not _kubeconfig_given():
        return "no in-cluster service account, KUBECONFIG unset and no ~/.kube/config"
    return None


def _kubeconfig_given() -> bool:
    from openalice_scheduler.providers.kubernetes import config_given

    return config_given()


def _kubernetes_problems(settings: Settings) -> list[str]:
    """The kubeconfig given cannot be read, or has no context K8S_CONTEXT (or no
    current one). Nothing is asked of the cluster."""
    from lightkube import ConfigError

    from openalice_scheduler.providers.kubernetes import load_config
    from openalice_scheduler.providers.kubernetes.kubeconfig import missing_files

    if not _kubeconfig_given():
        return []  # skipped with a warning, as a provider without credentials
    where = os.environ.get("KUBECONFIG") or "~/.kube/config"
    try:
        config = load_config(settings)
    except ConfigError as exc:  # no such file, context or current context
        name = "K8S_CONTEXT" if str(exc).startswith(("Context", "No current")) else "KUBECONFIG"
        return [f"{name}: {exc} (kubernetes, KUBECONFIG={where})"]
    except Exception as exc:  # noqa: BLE001 - unreadable, not YAML, not a kubeconfig
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}".rstrip(": ")
        return [f"KUBECONFIG: {where} is not a readable kubeconfig ({why})"]
    if missing := missing_files(config):
        return [f"KUBECONFIG: {', '.join(missing)} not found (kubernetes, KUBECONFIG={where})"]
    return []


def _fleet_problems(settings: Settings) -> list[str]:
    from openalice_scheduler.providers.docker.hosts import parse_hosts

    assert settings.docker_hosts
    problems = []
    try:
        parse_hosts(settings.docker_hosts)
    except ValueError as exc:
        problems.append(str(exc))
    # Each host declares its own; a single engine's settings beside them would be ignored.
    single = {
        "LOCAL_GPU_DEVICES": (settings.local_gpu_devices or "").strip(),
        "LOCAL_DOCKER_MAX_WORKERS": settings.local_docker_max_workers,
        "LOCAL_DOCKER_REGION": settings.local_docker_region,
    }
    for name, value in single.items():
        if value:
            problems.append(
                f"{name}: not used with DOCKER_HOSTS; give each host its "
                "gpus=, max= and region= there instead"
            )
    return problems


def _static_problems(settings: Settings) -> list[str]:
    from openalice_scheduler.providers.static import parse_static_workers

    if not settings.static_workers:
        return ["PROVIDERS lists static but STATIC_WORKERS is not set"]
    try:
        parse_static_workers(settings.static_workers)
    except ValueError as exc:
        return [str(exc)]
    return []


__all__ = [
    "REGISTRY",
    "Availability",
    "BoundedProvider",
    "ExplainingProvider",
    "InstantProvider",
    "PartialListing",
    "PlacingProvider",
    "Provider",
    "ProviderConfigError",
    "ProviderStatus",
    "Resync",
    "WatchingProvider",
    "Worker",
    "WorkerDeath",
    "WorkerEnded",
    "WorkerInfo",
    "WorkerSpec",
    "build_providers",
    "configuration_problems",
    "ready_timeouts",
]
