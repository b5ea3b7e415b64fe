"""Every environment variable the service reads, in one place (SPEC.md, Configuration):
`Settings`, with the settings of one area in a class of its own that it takes in
(runpod.py, priorities.py).

Settings are built once, in the CLI or by the caller of `create_app`, and passed down."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from openalice_scheduler.config.kubernetes import KubernetesSettings
from openalice_scheduler.config.modal import ModalSettings
from openalice_scheduler.config.priorities import PrioritySettings
from openalice_scheduler.config.runpod import RunPodSettings

KNOWN_LOG_LEVELS = ("trace", "debug", "info", "warn", "warning", "error", "off")
MIN_SECRET_LENGTH = 16


class Settings(RunPodSettings, ModalSettings, KubernetesSettings, PrioritySettings):
    model_config = SettingsConfigDict(env_file=None, extra="ignore", case_sensitive=False)

    internal_secret: SecretStr = Field(
        description="Shared secret for the gated endpoints (header X-Internal-Secret)."
    )
    scheduler_host: str = Field("0.0.0.0", description="Address to listen on.")
    scheduler_port: int = Field(8080, ge=1, le=65535, description="Port to listen on.")
    scheduler_instance: str = Field(
        "default",
        pattern=r"^[a-z0-9][a-z0-9-]{0,39}$",
        description="Name of this scheduler; labels its workers so it finds exactly its own.",
    )
    providers: str = Field("local-docker", description="Comma list of providers, in order.")
    policy: Literal["ordered-first-available", "cheapest-first"] = "ordered-first-available"
    max_leases_per_owner: int = Field(0, ge=0, description="Live leases per owner; 0 = no cap.")
    static_workers: str | None = Field(
        None, description="kind[:gpu]=url,url;... endpoints leased exclusively (static provider)."
    )
    static_region: str | None = None
    static_probe_interval_seconds: float = Field(
        10.0,
        ge=0,
        le=3600,
        description="How often each static endpoint is probed (RENDERER_READY_PATH, else "
        "a TCP connect); one that fails 3 times in a row is out of rotation (its lease, "
        "if any, ends `lost`) until it passes again; 0 = never probed, always in rotation.",
    )

    # Money (README, Prices and caps).
    local_docker_price_per_hour: str = Field(
        "0",
        description="What a local-docker worker costs, USD per hour: one price, or "
        "per GPU class `none=0.05,entry=0.4`; a DOCKER_HOSTS host's price= replaces it.",
    )
    static_price_per_hour: str = Field(
        "0",
        description="What a static endpoint's lease costs, USD per hour, as "
        "LOCAL_DOCKER_PRICE_PER_HOUR.",
    )
    local_gpu_type: str | None = Field(
        None,
        max_length=64,
        description="The GPU type local Docker's GPU workers get "
        "(e.g. NVIDIA GeForce RTX 4090), recorded as their leases' gpu_type.",
    )
    max_cost_per_hour_per_owner: float = Field(
        0.0,
        ge=0,
        description="USD per hour an owner's live leases may cost together; 0 = no cap.",
    )
    max_spend_per_day_per_owner: float = Field(
        0.0,
        ge=0,
        description="USD an owner may have spent over the last 24 h for a new "
        "priced lease to be granted; 0 = no cap.",
    )
    owner_budgets: str | None = Field(
        None,
        description="Per-owner caps replacing the two above, `owner=N/h:N/d,…` "
        "(e.g. `anim=5/h:80/d,live=2/h`); 0 lifts a cap.",
    )
    lease_retention_days: int = Field(
        90,
        ge=0,
        description="Ended leases older than this are purged in the background; 0 = kept for ever.",
    )
    database_url: str = Field("sqlite:///./openalice-scheduler.db")
    sqlite_synchronous: Literal["full", "normal"] = Field(
        "full",
        description="full: commits survive power loss; normal: survive a killed process, faster",
    )

    renderer_image: str = "openalice-demo-worker:latest"
    anim_image: str = "openalice-demo-worker:latest"
    renderer_port: int = Field(8080, ge=1, le=65535)
    anim_port: int = Field(8080, ge=1, le=65535)
    docker_network: str = Field("openalice", min_length=1)
    docker_host: str | None = Field(None, description="The Docker SDK's own; unset = local socket.")
    local_gpu_devices: str | None = Field(
        None, description="Comma list of GPU ids for gpu=entry; unset = what nvidia-smi lists."
    )
    local_docker_max_workers: int = Field(0, ge=0, description="Cap on live containers; 0 = none.")
    local_docker_region: str | None = Field(
        None, description="Region local Docker places in; unset = only requests without region."
    )
    docker_hosts: str | None = Field(
        None,
        description="A fleet of Docker engines for local-docker, `name=address "
        "option=value …` separated by `;` (README, A fleet of Docker hosts); unset = the "
        "one engine of DOCKER_HOST.",
    )

    renderer_ready_path: str | None = Field(
        None,
        pattern=r"^(/.*)?$",
        description="HTTP path a renderer worker answers 2xx on once "
        "ready; unset = a TCP connect to its port (README, Workers ready).",
    )
    anim_ready_path: str | None = Field(
        None, pattern=r"^(/.*)?$", description="As RENDERER_READY_PATH, for anim workers."
    )
    local_docker_ready_timeout_seconds: float = Field(
        60.0,
        ge=0,
        description="How long a new container has to pass its readiness probe; "
        "0 = not probed (handed out once started).",
    )

    warm_pool: str | None = Field(
        None,
        description="Idle, ready workers to keep per kind and GPU class, "
        "`kind/gpu=n,…` (e.g. `renderer/none=2,anim/entry=1`; README, Warm pools); "
        "unset = no pool.",
    )
    warm_pool_max_idle_seconds: float = Field(
        600.0,
        gt=0,
        description="A pool worker idle this long is recycled (destroyed and "
        "replaced by a fresh one).",
    )
    warm_handoff_path: str = Field(
        "/openalice/lease",
        pattern=r"^/",
        description="Path on a pool worker that the "
        "hand-off (the lease id, expiry, kind and env) is POSTed to when it is leased.",
    )
    scheduler_public_url: str | None = Field(
        None,
        pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$",
        description="How workers reach "
        "the scheduler (http://scheduler:8080): each worker is given LEASE_SELF_URL and "
        "LEASE_TOKEN under it, to ask after its own lease; unset = workers are not told.",
    )
    warm_handoff_timeout_seconds: float = Field(
        5.0,
        gt=0,
        le=300,
        description="How long a pool worker has to answer its hand-off "
        "2xx; else it is destroyed and the acquire goes cold.",
    )

    sweep_interval_seconds: float = Field(30.0, gt=0, le=3600)
    reconcile_interval_seconds: float = Field(60.0, gt=0, le=86400)
    provision_timeout_seconds: float = Field(600.0, gt=0)
    startup_timeout_seconds: float = Field(
        60.0,
        ge=0,
        description="How long start-up retries an unreachable PostgreSQL; 0 = try once.",
    )
    shutdown_grace_seconds: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="On SIGTERM: how long requests under way (a "
        "provision, say) have to finish and be answered before the process exits.",
    )

    otel_exporter_otlp_endpoint: str | None = None
    otel_service_name: str = "openalice-scheduler"
    rust_log: str | None = None
    log_level: str | None = None
    log_format: Literal["text", "json"] = Field(
        "text",
        description="text: one line per record for people; json: one JSON object "
        "per line, with lease, request and trace ids as fields (README, Logs).",
    )
    cors_origins: str | None = None
    http_parser: Literal["h11", "httptools"] = Field(
        "h11",
        description="uvicorn's HTTP parser. h11 caps a request's header block "
        "(64 KiB) before it is buffered; httptools costs about half as much per request "
        "but buffers headers of any size: use it only behind a proxy that caps them.",
    )
    metrics_owner_series: bool = Field(
        False,
        description="Serve scheduler_owner_leases{owner} and "
        "scheduler_owner_spend_dollars_total{owner}: owner ids on the ungated /metrics.",
    )

    # What the scheduler keeps of the guards that poll it (README, The guard).
    max_guards: int = Field(
        64,
        ge=1,
        le=100_000,
        description="Most guards the scheduler records; a new one past it is a 429 "
        "too_many_guards, the known ones poll on.",
    )
    guard_forget_seconds: float = Field(
        86_400.0,
        ge=1,
        description="A guard silent this long is forgotten (its row and its metric "
        "series); keep it well above the SchedulerGuardSilent alert's 5 minutes.",
    )

    # The guard (`openalice-scheduler guard`; README, The guard). The scheduler ignores them.
    guard_scheduler_url: str | None = Field(
        None,
        pattern=r"^https?://[^,\s]+(,https?://[^,\s]+)*$",
        description="Comma list of the scheduler replicas' base URLs the guard polls.",
    )
    guard_id: str | None = Field(
        None,
        pattern=r"^[\x21-\x2b\x2d-\x7e]{1,128}$",
        description="The guard's name in GET /v1/providers; unset = its host name.",
    )
    guard_poll_seconds: float = Field(10.0, gt=0, le=3600)
    guard_silence_seconds: float = Field(60.0, gt=0)
    guard_grace_seconds: float = Field(30.0, ge=0)
    guard_state_file: str = Field(
        "./openalice-guard.json",
        min_length=1,
        description="Where the guard keeps what it learned, across its own restarts.",
    )

    @field_validator("internal_secret")
    @classmethod
    def _secret_not_empty(cls, value: SecretStr) -> SecretStr:
        secret = value.get_secret_value().strip()
        if not secret:
            raise ValueError("must be set and not empty: gated routes are never served open")
        if len(secret) < MIN_SECRET_LENGTH:
            raise ValueError(
                f"must be at least {MIN_SECRET_LENGTH} characters, got {len(secret)} "
                "(e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        return value

    @field_validator("database_url")
    @classmethod
    def _known_database(cls, value: str) -> str:
        if not re.match(r"^(sqlite|postgresql|postgres)(\+\w+)?://", value):
            raise ValueError("must start with sqlite:/// or postgresql://")
        # Parsed now, so that a bad URL is reported with the other variables. The
        # parser's own message is not repeated: it may quote the password.
        try:
            make_url(value)
        except (ArgumentError, ValueError):
            raise ValueError(
                "is not a valid URL (is the port a number? is a special "
                "character in the password percent-encoded?)"
            ) from None
        return value

    @field_validator("docker_host")
    @classmethod
    def _docker_address(cls, value: str | None) -> str | None:
        # What the Docker SDK accepts here (without paramiko for ssh://); it would refuse
        # anything else only when the provider is built.
        if not value:
            return value
        scheme, sep, rest = value.partition("://")
        try:
            port = urlsplit(value).port
        except ValueError:
            port = None
        if (
            not sep
            or scheme not in ("unix", "tcp", "http", "https")
            or not rest
            or (scheme != "unix" and port is None)
        ):
            raise ValueError(
                "must be unix:///path/to/docker.sock or tcp://host:port "
                "(http:// and https:// also work)"
            )
        return value

    @field_validator("providers")
    @classmethod
    def _providers_not_empty(cls, value: str) -> str:
        if not [name for name in value.split(",") if name.strip()]:
            raise ValueError("lists no provider; give at least one, e.g. local-docker")
        return value

    @field_validator("rust_log", "log_level")
    @classmethod
    def _log_filter(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        for part in value.split(","):
            level = part.split("=", 1)[-1].strip().lower()
            if level not in KNOWN_LOG_LEVELS:
                known = ", ".join(KNOWN_LOG_LEVELS)
                raise ValueError(f"unknown level {level!r}; use one of {known}")
        return value

    @field_validator("local_gpu_devices")
    @classmethod
    def _gpu_ids(cls, value: str | None) -> str | None:
        for device in (value or "").split(","):
            if device.strip() and not re.fullmatch(r"[A-Za-z0-9-]+", device.strip()):
                raise ValueError(f"{device.strip()!r} is not a GPU index or UUID")
        return value

    @field_validator("local_docker_price_per_hour", "static_price_per_hour", "k8s_price_per_hour")
    @classmethod
    def _prices_syntax(cls, value: str) -> str:
        from openalice_scheduler.prices import parse_prices

        parse_prices(value)
        return value

    @field_validator("owner_budgets")
    @classmethod
    def _budgets_syntax(cls, value: str | None) -> str | None:
        from openalice_scheduler.prices import parse_owner_budgets

        parse_owner_budgets(value)
        return value

    @field_validator("warm_pool")
    @classmethod
    def _warm_pool_syntax(cls, value: str | None) -> str | None:
        parse_warm_pool(value)
        return value

    @property
    def warm_pool_targets(self) -> dict[tuple[str, str], int]:
        """WARM_POOL as {(kind, gpu): idle workers to keep}."""
        return parse_warm_pool(self.warm_pool)

    @property
    def provider_names(self) -> list[str]:
        return [name.strip() for name in self.providers.split(",") if name.strip()]

    @property
    def gpu_devices(self) -> list[str]:
        if self.local_gpu_devices is None:
            return _nvidia_smi_devices()
        return [d.strip() for d in self.local_gpu_devices.split(",") if d.strip()]

    @property
    def worker_images(self) -> dict[str, str]:
        """Image per worker kind (RENDERER_IMAGE, ANIM_IMAGE)."""
        return {"renderer": self.renderer_image, "anim": self.anim_image}

    @property
    def ready_paths(self) -> dict[str, str | None]:
        """Readiness path per worker kind (RENDERER_READY_PATH, ANIM_READY_PATH)."""
        return {"renderer": self.renderer_ready_path or None, "anim": self.anim_ready_path or None}

    @property
    def worker_ports(self) -> dict[str, int]:
        """Port a worker serves on, per kind (RENDERER_PORT, ANIM_PORT)."""
        return {"renderer": self.renderer_port, "anim": self.anim_port}

    @property
    def cors_origin_list(self) -> list[str]:
        if not self.cors_origins:
            return []
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]

    @property
    def log_filter(self) -> str:
        return self.rust_log or self.log_level or "info"

    def secrets(self) -> list[str]:
        """Values that must never be printed, for the log redaction filter."""
        found = [self.internal_secret.get_secret_value()]
        if self.runpod_api_key is not None:
            found.append(self.runpod_api_key.get_secret_value())
        found.extend(_url_passwords(self.database_url))
        return list(dict.fromkeys(s for s in found if s))


def parse_warm_pool(value: str | None) -> dict[tuple[str, str], int]:
    """`renderer/none=2,anim/entry=1` as {(kind, gpu): n}; ValueError naming the bad part."""
    from openalice_scheduler.models import GpuClass, WorkerKind

    kinds, gpus = [k.value for k in WorkerKind], [g.value for g in GpuClass]
    targets: dict[tuple[str, str], int] = {}
    for part in (value or "").split(","):
        if not part.strip():
            continue
        match = re.fullmatch(r"\s*([a-z]+)/([a-z]+)\s*=\s*(\d{1,4})\s*", part)
        if match is None:
            raise ValueError(f"{part.strip()[:64]!r} is not kind/gpu=count (e.g. renderer/none=2)")
        kind, gpu, count = match[1], match[2], int(match[3])
        if kind not in kinds:
            raise ValueError(
                f"unknown kind {kind!r} in {part.strip()!r}; use one of " + ", ".join(kinds)
            )
        if gpu not in gpus:
            raise ValueError(
                f"unknown GPU class {gpu!r} in {part.strip()!r}; use one of " + ", ".join(gpus)
            )
        if (kind, gpu) in targets:
            raise ValueError(f"{kind}/{gpu} is given twice")
        targets[(kind, gpu)] = count
    return targets


def _url_passwords(url: str) -> list[str]:
    """The password of a database URL, decoded and as written (percent-encoded), and any
    password among its query parameters (`?password=…`, libpq's `sslpassword=…`)."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return []
    found = [str(parsed.password or ""), urlsplit(url).password or ""]
    for key, value in parsed.query.items():
        if "password" in key.lower():
            found += [value] if isinstance(value, str) else list(value)
    return found


def _nvidia_smi_devices() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return re.findall(r"^GPU (\d+):", out, flags=re.MULTILINE)
