"""Every environment variable the service reads, in one place: `Settings`, made of one
class per area (service.py, store.py, loops.py, docker.py, readiness.py, pool.py,
money.py, static.py, observability.py, guard.py, runpod.py, modal.py, kubernetes.py,
kubernetes_pods.py, priorities.py), each field with its default, bounds and description.
The configuration reference (docs/reference/configuration.md) is made from these classes
(reference.py).

Settings are built once, in the CLI or by the caller of `create_app`, and passed down."""

from __future__ import annotations

from pydantic import field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from openalice_scheduler.config.docker import DockerSettings
from openalice_scheduler.config.guard import GuardSettings
from openalice_scheduler.config.kubernetes import KubernetesSettings
from openalice_scheduler.config.kubernetes_pods import KubernetesPodSettings
from openalice_scheduler.config.loops import LoopSettings
from openalice_scheduler.config.modal import ModalSettings
from openalice_scheduler.config.money import MoneySettings
from openalice_scheduler.config.observability import KNOWN_LOG_LEVELS, ObservabilitySettings
from openalice_scheduler.config.pool import PoolEntry, PoolSettings, parse_warm_pool
from openalice_scheduler.config.priorities import PrioritySettings
from openalice_scheduler.config.readiness import ReadinessSettings
from openalice_scheduler.config.runpod import RunPodSettings
from openalice_scheduler.config.service import MIN_SECRET_LENGTH, ServiceSettings
from openalice_scheduler.config.static import StaticSettings
from openalice_scheduler.config.store import StoreSettings, url_passwords

# The areas, in the order the reference shows them, with their section titles.
AREAS: tuple[tuple[str, type[BaseSettings]], ...] = (
    ("Service", ServiceSettings),
    ("State store", StoreSettings),
    ("Loops", LoopSettings),
    ("Docker", DockerSettings),
    ("Readiness", ReadinessSettings),
    ("Warm pool", PoolSettings),
    ("Prices and caps", MoneySettings),
    ("Static endpoints", StaticSettings),
    ("Logs, metrics and traces", ObservabilitySettings),
    ("The guard", GuardSettings),
    ("RunPod", RunPodSettings),
    ("Modal", ModalSettings),
    ("Kubernetes", KubernetesSettings),
    ("Kubernetes pods", KubernetesPodSettings),
    ("Priorities", PrioritySettings),
)


class Settings(
    ServiceSettings,
    StoreSettings,
    LoopSettings,
    DockerSettings,
    ReadinessSettings,
    PoolSettings,
    MoneySettings,
    StaticSettings,
    ObservabilitySettings,
    GuardSettings,
    RunPodSettings,
    ModalSettings,
    KubernetesSettings,
    KubernetesPodSettings,
    PrioritySettings,
):
    model_config = SettingsConfigDict(env_file=None, extra="ignore", case_sensitive=False)

    @field_validator("local_docker_price_per_hour", "static_price_per_hour", "k8s_price_per_hour")
    @classmethod
    def _prices_syntax(cls, value: str) -> str:
        from openalice_scheduler.prices import parse_prices

        parse_prices(value)
        return value

    @model_validator(mode="after")
    def _pool_classes(self) -> Settings:
        """A pool serves classes that exist (PRIORITY_CLASSES)."""
        known = self.priority_table
        for (kind, gpu), entry in self.warm_pools.items():
            for name in sorted(entry.classes or ()):
                if name not in known:
                    raise ValueError(
                        f"WARM_POOL: the pool {kind}/{gpu} serves {name!r}, which is not a "
                        f"class of PRIORITY_CLASSES ({', '.join(sorted(known))})"
                    )
        return self

    def secrets(self) -> list[str]:
        """Values that must never be printed, for the log redaction filter."""
        found = [self.internal_secret.get_secret_value()]
        for key in (self.runpod_api_key, self.modal_token_secret):
            if key is not None:
                found.append(key.get_secret_value())
        found.extend(url_passwords(self.database_url))
        return list(dict.fromkeys(s for s in found if s))


__all__ = [
    "AREAS",
    "KNOWN_LOG_LEVELS",
    "MIN_SECRET_LENGTH",
    "PoolEntry",
    "Settings",
    "parse_warm_pool",
]
