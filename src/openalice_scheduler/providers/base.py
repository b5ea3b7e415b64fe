"""The contract every provider keeps. The service owns leases and their states; a
provider only creates and destroys workers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, runtime_checkable

from openalice_scheduler.capacity import Placement
from openalice_scheduler.config import Settings
from openalice_scheduler.models import GpuClass, LostCause, WorkerKind


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What to create: one worker for one lease."""

    lease_id: str
    kind: WorkerKind
    gpu: GpuClass
    expires_at: datetime
    owner_id: str | None = None
    correlation_id: str | None = None
    region: str | None = None
    # Exclusive resource reserved for this lease by the store (a GPU device id).
    resource: str | None = None
    # The state store recording the lease (LeaseStore.store_id), for providers that label
    # their workers with it.
    store_id: str | None = None
    # Passed to the worker only; never logged, stored or traced.
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    # The lease's fencing token, given when it was reserved.
    fence: int | None = None
    # Where the worker asks after its own lease, and the token for it (lease_access.py);
    # None when SCHEDULER_PUBLIC_URL is unset. The token goes to the worker only.
    self_url: str | None = None
    token: str | None = field(default=None, repr=False)
    # The most this worker may cost, USD per hour, when the owner has a cap in money: the
    # price its lease was checked against. None: no such bound.
    max_price_per_hour: float | None = None
    # The lease's priority class (PRIORITY_CLASSES), for providers that map it to one of
    # their own (Kubernetes' PriorityClass); None for a warm pool's worker.
    priority_class: str | None = None


def worker_env(spec: WorkerSpec, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The worker's environment: the caller's `env`, then `LEASE_ID`, `LEASE_EXPIRES_AT`
    (RFC 3339 UTC, as the lease's `expires_at`), `WORKER_KIND`, `LEASE_FENCE`, and
    `LEASE_SELF_URL` with `LEASE_TOKEN` when the scheduler has a public URL, then a
    provider's own `extra` keys. The scheduler's keys win over the caller's: a caller
    cannot make a worker believe it serves another lease, lives longer than its lease,
    or holds a newer fence."""
    env = {
        **spec.env,
        "LEASE_ID": spec.lease_id,
        "LEASE_EXPIRES_AT": spec.expires_at.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "WORKER_KIND": spec.kind.value,
    }
    for key in ("LEASE_FENCE", "LEASE_SELF_URL", "LEASE_TOKEN"):
        env.pop(key, None)  # only the scheduler's own, or none
    if spec.fence is not None:
        env["LEASE_FENCE"] = str(spec.fence)
    if spec.self_url is not None and spec.token is not None:
        env["LEASE_SELF_URL"], env["LEASE_TOKEN"] = spec.self_url, spec.token
    return {**env, **(extra or {})}


@dataclass(frozen=True, slots=True)
class Worker:
    endpoint: str
    provider_token: str
    # Where the scheduler itself reaches the worker for its readiness probe (probe.py),
    # when that is not the endpoint: a Docker endpoint's name resolves only inside
    # DOCKER_NETWORK, the container's address on it is reachable from the host too.
    probe_url: str | None = None
    # The worker is behind an HTTP proxy that accepts connections whether or not the
    # worker listens (RunPod's): a TCP connect proves nothing, an HTTP answer does.
    behind_proxy: bool = False
    # What the provider says the worker is and costs (RunPod: the pod's own GPU type and
    # cost), recorded on the lease; None: the GPU type is unknown, the price is the one
    # reserved with the lease (the provider's `price`).
    gpu_type: str | None = None
    price_per_hour: float | None = None


@dataclass(frozen=True, slots=True)
class WorkerDeath:
    """How a worker stopped, as its backend tells it
    (docs/concepts/readiness-and-loss.md#a-worker-lost-after-its-hand-out): the cause, its exit code
    when the backend gives one, and the backend's own words."""

    cause: LostCause
    exit_code: int | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker found on the backend, for reconciliation."""

    lease_id: str
    provider_token: str
    # The state store the worker was made for, when the backend records it (a label).
    store_id: str | None = None
    # Set once the worker has stopped for good (its container exited, its pod failed);
    # None while it runs or is still starting.
    death: WorkerDeath | None = None
    # The backend is already ending it (a pod deleted, in its grace period): an orphan
    # destroyed once, not again at each pass until it is gone.
    ending: bool = False


@dataclass(frozen=True, slots=True)
class WorkerEnded:
    """A worker's death, heard from its backend's event stream: the worker with this
    token (of the lease `lease_id`, when the backend labels it) stopped for good."""

    lease_id: str | None
    provider_token: str
    death: WorkerDeath


@dataclass(frozen=True, slots=True)
class Resync:
    """The event stream (re)opened: what it may have missed meanwhile is for a listing."""

    where: str = ""


class PartialListing(dict[str, list[WorkerInfo]]):
    """`list_workers()` of a provider with places of its own (the hosts of a fleet)
    when some could not be listed: the workers of those that could, by lease id, and in
    `unlisted` the names of the others. Reconciliation leaves the leases on those
    (`LeaseRecord.host`) as they are this pass: their workers are unknown, not gone."""

    def __init__(self, workers: Mapping[str, list[WorkerInfo]], unlisted: frozenset[str]):
        super().__init__(workers)
        self.unlisted = unlisted


@dataclass(frozen=True, slots=True)
class Availability:
    ok: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ProviderStatus:
    """What `GET /v1/providers` shows of a provider, before usage is added."""

    healthy: bool
    detail: str = ""
    # Per GPU class this provider serves: how many workers at most (None: no fixed cap).
    capacity: dict[str, int | None] = field(default_factory=dict)
    # For a provider whose capacity is split by worker kind (static endpoints): per kind,
    # per GPU class, how many workers at most. Without it, the kinds share `capacity`.
    by_kind: dict[str, dict[str, int]] | None = None
    # For a provider with places of its own (the hosts of a fleet): one entry each, as
    # `GET /v1/providers` shows it (models.HostView).
    hosts: list[dict[str, Any]] | None = None


@runtime_checkable
class Provider(Protocol):
    """A backend that creates and destroys workers.

    - `available(spec)` is cheap and says whether this provider could serve the request
      at all right now (kind, GPU class, region, backend reachable); when not, `reason`
      says why in words a caller understands. Capacity caps are checked by the store.
    - `provision(spec)` creates the worker and returns once it runs (container started,
      pod RUNNING), saying in the Worker where the scheduler can probe it; the service
      then waits until it is ready (probe.py) before the lease is answered. On failure it
      raises ProviderError and leaves nothing behind that it knows of; the service still
      calls `release("", lease_id)` afterwards, to catch what a timeout half-made.
    - `release(token, lease_id)` destroys the worker with that token or, when the token
      is empty (a provision cut short), every worker labelled with that lease id. It is
      idempotent: an already-gone worker is success. It raises ProviderError when the
      backend could not confirm.
    - `list_workers()` returns every worker labelled as this scheduler instance's, by
      lease id, so reconciliation can find orphans, vanished workers and workers that
      stopped (`WorkerInfo.death`); None when the provider does not make its workers
      (static endpoints): nothing to reconcile.
    - A provider whose workers already exist (static endpoints) is an InstantProvider.
    - `price(spec)` is the cost per hour of a worker for `spec` (None: unknown), for
      the cheapest-first policy; `status()` is its health and capacity per GPU class.
    """

    name: str
    max_workers: int
    # What `exclusive_resources` are, in words for a refusal ("all 2 GPU devices are leased").
    resource_label: str

    def exclusive_resources(self, spec: WorkerSpec) -> Sequence[str] | None:
        """The pool one of which this lease must hold exclusively (GPU devices), or None."""
        ...

    async def available(self, spec: WorkerSpec) -> Availability: ...

    async def provision(self, spec: WorkerSpec) -> Worker: ...

    async def release(self, provider_token: str, lease_id: str) -> None: ...

    async def list_workers(self) -> Mapping[str, list[WorkerInfo]] | None: ...

    async def price(self, spec: WorkerSpec) -> float | None: ...

    async def status(self) -> ProviderStatus: ...

    async def close(self) -> None: ...


@runtime_checkable
class InstantProvider(Provider, Protocol):
    """A provider whose workers already run (static endpoints): nothing to create or
    destroy. `assign(resource)` names the worker behind a reserved resource, as
    (endpoint, provider_token), without calling anything; the service records such a
    lease `active` in the transaction that reserves it, and `released` in the one that
    releases it, and calls neither `provision` nor `release`."""

    def assign(self, resource: str | None) -> tuple[str, str]: ...


@runtime_checkable
class PlacingProvider(Provider, Protocol):
    """A provider whose workers go to one of several places of its own (the hosts of a
    local-docker fleet), chosen in the store's reservation transaction, so that per-place
    caps and exclusive devices hold across replicas. `placer(spec)` returns the choice:
    given the resources the provider's other live leases hold, the resource and place
    of this lease (a Placement), or it raises AtCapacity saying why none fits. The
    place is recorded as the lease's `host`, and `spec.resource` names it to `provision`."""

    def placer(self, spec: WorkerSpec) -> Callable[[Set[str]], Placement]: ...


@runtime_checkable
class BoundedProvider(Provider, Protocol):
    """A provider whose backend itself ends every worker a fixed time after its creation
    (Modal: the sandbox's `timeout`), whatever the scheduler does: a lease on it lives at
    most `max_lifetime_seconds` from its creation, renewals included. An acquire whose
    TTL is longer is not served there, and a renewal past it is refused (409)."""

    max_lifetime_seconds: float


@runtime_checkable
class WatchingProvider(Provider, Protocol):
    """A provider whose backend streams its workers' lives (the Docker engine's events, a
    Kubernetes watch; static endpoints, whose own probes are their stream): `watch()`
    yields each death as it is heard, and a Resync whenever the stream (re)opens (first
    of all), so that what it missed meanwhile is found by a listing. It reconnects by
    itself, with backoff, and ends only when cancelled (or at once, when its provider
    has nothing to watch)."""

    def watch(self) -> AsyncIterator[WorkerEnded | Resync]: ...


@runtime_checkable
class ExplainingProvider(Provider, Protocol):
    """A provider whose listing omits a worker that stopped (Modal lists running
    sandboxes only), but which can still say how one stopped: `death_of(token)` is its
    death, or None while it still runs (the listing was behind)."""

    async def death_of(self, provider_token: str) -> WorkerDeath | None: ...


def lease_bound(worker_lifetime_seconds: float, settings: Settings) -> float:
    """A BoundedProvider's `max_lifetime_seconds` when its backend ends every worker
    `worker_lifetime_seconds` after the worker's start. A lease's life counts from its
    `created_at`: a cold lease's worker starts after that, a warm-pool worker before it
    (while warming and idle: at most a provision and WARM_POOL_MAX_IDLE_SECONDS), so with
    a pool that much is kept back, and a lease never outlives its worker."""
    pooled = settings.warm_pool_max_idle_seconds + settings.provision_timeout_seconds
    return worker_lifetime_seconds - (pooled if settings.warm_pool else 0.0)


def past_bound(spec: WorkerSpec, provider: BoundedProvider, setting: str) -> Availability | None:
    """Why `provider` cannot serve `spec` when its TTL is longer than a lease there may
    live (`setting` names what sets the bound); None when it is within."""
    lifetime = (spec.expires_at - datetime.now(UTC)).total_seconds()
    if lifetime <= provider.max_lifetime_seconds:
        return None
    return Availability(
        False,
        f"a lease on {provider.name} lives at most {provider.max_lifetime_seconds:g} s "
        f"({setting}, less the warm pool's idle time)",
    )
