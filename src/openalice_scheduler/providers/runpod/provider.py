"""runpod: workers as RunPod pods. Maps leases to pod requests and pods back to workers;
the raw API is `client.py`'s business.

Pods have no labels, so a pod is named `oa-<SCHEDULER_INSTANCE>-<lease_id>` and carries
`LEASE_ID`, `OPENALICE_SCHEDULER_INSTANCE` and `OPENALICE_SCHEDULER_STORE` (the state
store's id) in its env; reconciliation keeps only those names, and leaves pods made for
another state store to that store's scheduler."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from openalice_scheduler.config import Settings
from openalice_scheduler.errors import (
    ProviderError,
    ProviderOutOfCapacity,
    ProviderUnavailable,
)
from openalice_scheduler.logs import lease_ref
from openalice_scheduler.models import GpuClass, LostCause, WorkerKind
from openalice_scheduler.providers.base import (
    Availability,
    ProviderStatus,
    Worker,
    WorkerDeath,
    WorkerInfo,
    WorkerSpec,
    worker_env,
)
from openalice_scheduler.providers.runpod.client import (
    ErrorKind,
    GpuStock,
    Pod,
    PodRequest,
    RunPodClient,
    RunPodError,
    build_client,
)
from openalice_scheduler.providers.runpod.starting import StartWatch

log = logging.getLogger(__name__)
# The pod's env entry naming the state store it was made for (see WorkerInfo.store_id).
STORE_ENV = "OPENALICE_SCHEDULER_STORE"

_STOCK_RANK = {"HIGH": 3, "MEDIUM": 2, "LOW": 1, "NONE": 0}
_KEY_RECHECK_S = 300.0
_CREATE_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Candidate:
    gpu_type_id: str | None  # None: a CPU pod
    data_center_ids: tuple[str, ...]
    price: float = 0.0


@dataclass(frozen=True, slots=True)
class _Choice:
    """Pod shapes to try, best first; when there are none, why, and whether only stock is
    missing (it may come back: out of capacity, not a failure)."""

    candidates: list[Candidate]
    reason: str = ""
    no_stock: bool = False


class RunPodProvider:
    name = "runpod"
    resource_label = "GPU devices"

    def __init__(self, settings: Settings, client: RunPodClient | None = None) -> None:
        assert settings.runpod_api_key is not None
        self.client = client or build_client(
            settings.runpod_api,
            settings.runpod_api_key.get_secret_value(),
            settings.runpod_api_base_url,
            timeout=settings.runpod_request_timeout_seconds,
        )
        self.api = settings.runpod_api
        self.instance = settings.scheduler_instance
        self.prefix = f"oa-{self.instance}-"
        self.max_workers = settings.runpod_max_pods
        self.cloud = settings.runpod_cloud
        self.cpu_flavor = settings.runpod_cpu_flavor
        self.disk_gb = settings.runpod_disk_gb
        self.poll_interval = settings.runpod_poll_interval_seconds
        self.catalog_ttl = settings.runpod_catalog_ttl_seconds
        self.templates = {
            WorkerKind.renderer: settings.runpod_renderer_template,
            WorkerKind.anim: settings.runpod_anim_template,
        }
        self.images = settings.worker_images
        self.ports = settings.worker_ports
        self.proxy_url = settings.runpod_proxy_url
        self.gpu_types = {
            c: settings.runpod_gpu_types(c.value)
            for c in (GpuClass.entry, GpuClass.mid, GpuClass.high)
        }
        self._key_rejected_at: float | None = None
        self._catalog: tuple[float, list[GpuStock]] | None = None
        self._catalog_fetch: asyncio.Future[list[GpuStock]] | None = None
        # Pods being waited for until they run (or die).
        self.starting = StartWatch(self.client, self.poll_interval, self._provider_error)
        # What pods cost, USD per hour, as their create answers said, by GPU type id
        # (`cpu` for CPU pods): a price for shapes the catalog does not price.
        self._seen_cost: dict[str, float] = {}

    def pod_name(self, lease_id: str) -> str:
        return f"{self.prefix}{lease_id}"

    def exclusive_resources(self, spec: WorkerSpec) -> Sequence[str] | None:
        return None

    async def available(self, spec: WorkerSpec) -> Availability:
        if self._key_rejected():
            return Availability(False, "RunPod rejected RUNPOD_API_KEY (401)")
        try:
            choice = await self._candidates(spec)
        except RunPodError as exc:
            return Availability(False, self._describe(exc))
        return Availability(bool(choice.candidates), choice.reason)

    async def provision(self, spec: WorkerSpec) -> Worker:
        """The pod, running. Raises ProviderOutOfCapacity when RunPod has no capacity for
        any candidate (the catalog says no stock, or every create was refused with
        RunPod's no-instances answer, though the catalog showed stock a moment before);
        any other refusal among them (a broken rule, no access) is a ProviderError."""
        try:
            choice = await self._candidates(spec)
        except RunPodError as exc:
            raise self._provider_error(exc) from exc
        if not choice.candidates:
            if choice.no_stock:
                raise ProviderOutOfCapacity(choice.reason)
            raise ProviderError(choice.reason, transient=False)
        name = self.pod_name(spec.lease_id)
        refusals: list[str] = []
        all_capacity = True
        candidates = self._affordable(choice.candidates, spec.max_price_per_hour)
        if not candidates:
            raise ProviderOutOfCapacity(
                f"RunPod has no stock for gpu={spec.gpu} at or under "
                f"{spec.max_price_per_hour:g} $/h, the price the owner's cap allowed"
            )
        for candidate in candidates:
            request = self._pod_request(spec, name, candidate)
            try:
                pod = await self._create(request)
            except RunPodError as exc:
                what = candidate.gpu_type_id or f"CPU {self.cpu_flavor}"
                if exc.kind in (ErrorKind.rejected, ErrorKind.forbidden):
                    log.info("lease %s: RunPod refused %s: %s", lease_ref(spec), what, exc.detail)
                    refusals.append(f"{what}: {exc.detail}")
                    all_capacity = all_capacity and exc.no_capacity
                    continue
                raise self._provider_error(exc) from exc
            # RunPod's proxy answers for the pod whether or not it listens (behind_proxy).
            cost = self._cost_of(pod, candidate)
            return Worker(
                endpoint=await self._wait_running(pod, spec),
                provider_token=pod.id,
                behind_proxy=True,
                price_per_hour=cost,
                gpu_type=pod.gpu_type or candidate.gpu_type_id,
            )
        self._catalog = None  # stock moved under us: look again next time
        if all_capacity:
            raise ProviderOutOfCapacity(
                f"RunPod has no capacity for gpu={spec.gpu}: " + "; ".join(refusals[-3:])
            )
        raise ProviderError(
            "RunPod could not place the pod: " + "; ".join(refusals[-3:]), transient=False
        )

    async def release(self, provider_token: str, lease_id: str) -> None:
        try:
            if provider_token:
                await self.client.terminate_pod(provider_token)
                return
            for pod in await self.client.list_pods():
                if pod.name == self.pod_name(lease_id):
                    await self.client.terminate_pod(pod.id)
        except RunPodError as exc:
            raise self._provider_error(exc) from exc

    async def list_workers(self) -> Mapping[str, list[WorkerInfo]]:
        try:
            pods = await self.client.list_pods()
        except RunPodError as exc:
            raise self._provider_error(exc) from exc
        found: dict[str, list[WorkerInfo]] = defaultdict(list)
        for pod in pods:
            lease_id = self._lease_of(pod)
            if lease_id is not None and pod.status != "TERMINATED":
                found[lease_id].append(
                    WorkerInfo(lease_id, pod.id, pod.env.get(STORE_ENV), _death(pod))
                )
        return found

    async def price(self, spec: WorkerSpec) -> float | None:
        """USD per hour of the cheapest candidate with stock; None when unknown or when
        nothing can be placed."""
        try:
            candidates = (await self._candidates(spec)).candidates
        except RunPodError:
            return None
        # The catalog prices GPUs only (GraphQL: nothing): a CPU candidate's 0.0 is a
        # placeholder, not "free". What such pods cost is known once one was made (its
        # create answer); until then the price is unknown, or cheapest-first would tie
        # RunPod CPU pods with free local Docker and pay for what Docker does for free.
        known = [p for c in candidates if (p := self._known_price(c)) is not None]
        return min(known) if known else None

    def _known_price(self, candidate: Candidate) -> float | None:
        """USD per hour of a pod of this shape: the catalog's, else the last seen."""
        return candidate.price or self._seen_cost.get(candidate.gpu_type_id or "cpu")

    def _affordable(self, candidates: list[Candidate], most: float | None) -> list[Candidate]:
        """The candidates not known to cost more than `most` (None: all)."""
        if most is None:
            return candidates
        return [
            c for c in candidates if (price := self._known_price(c)) is None or price <= most + 1e-9
        ]

    def _cost_of(self, pod: Pod, candidate: Candidate) -> float | None:
        """What the new pod costs per hour: its own answer's, else the catalog's price."""
        cost = pod.cost_per_hr if pod.cost_per_hr else (candidate.price or None)
        if cost is not None:
            self._seen_cost[candidate.gpu_type_id or "cpu"] = cost
        return cost

    async def status(self) -> ProviderStatus:
        cap = self.max_workers or None
        capacity: dict[str, int | None] = {
            gpu.value: cap for gpu, types in self.gpu_types.items() if types
        }
        if self.api == "rest":
            capacity[GpuClass.none.value] = cap
        if self._key_rejected():
            return ProviderStatus(False, "RunPod rejected RUNPOD_API_KEY (401)", capacity)
        try:
            if self.api == "rest":
                self._catalog = None  # a fresh look, not the cached one
                await self._gpu_catalog()
            else:
                await self.client.list_pods()
        except RunPodError as exc:
            self._note(exc)
            return ProviderStatus(False, self._describe(exc), capacity)
        return ProviderStatus(True, "", capacity)

    async def close(self) -> None:
        self.starting.close()
        if self._catalog_fetch is not None and not self._catalog_fetch.done():
            self._catalog_fetch.cancel()
        await self.client.close()

    # --- candidates --------------------------------------------------------------------

    async def _candidates(self, spec: WorkerSpec) -> _Choice:
        """Pod shapes to try, best first, or none and why."""
        if spec.gpu == GpuClass.none:
            if self.api == "graphql":
                return _Choice([], "gpu=none needs CPU pods, which RunPod serves on REST v2 only")
            if spec.region is None:
                return _Choice([Candidate(None, ())])
            catalog = await self._gpu_catalog()
            in_region = tuple(
                sorted(
                    {
                        dc
                        for gpu in catalog or []
                        for dc in gpu.data_centers
                        if _in_region(dc, spec.region)
                    }
                )
            )
            if catalog is not None and not in_region:
                return _Choice([], f"RunPod has no data center in region {spec.region!r}")
            return _Choice([Candidate(None, in_region or (spec.region,))])

        wanted = self.gpu_types[spec.gpu]
        if not wanted:
            return _Choice([], f"no RunPod GPU types configured for gpu={spec.gpu}")
        catalog = await self._gpu_catalog()
        if catalog is None:  # GraphQL: no catalog; the configured order, region as given
            given: tuple[str, ...] = (spec.region,) if spec.region else ()
            return _Choice([Candidate(gpu, given) for gpu in wanted])

        by_id = {gpu.id: gpu for gpu in catalog}
        ranked: list[tuple[float, int, int, Candidate]] = []
        no_stock: list[str] = []
        for index, gpu_id in enumerate(wanted):
            stock = by_id.get(gpu_id)
            if stock is None or stock.availability == "NONE":
                no_stock.append(gpu_id)
                continue
            centers: tuple[str, ...] = ()
            if spec.region:
                centers = tuple(
                    dc
                    for dc, level in stock.data_centers.items()
                    if _in_region(dc, spec.region) and level != "NONE"
                )
                if not centers:
                    no_stock.append(f"{gpu_id} in {spec.region}")
                    continue
            price = stock.price_secure if self.cloud == "SECURE" else stock.price_community
            candidate = Candidate(gpu_id, centers, price)
            # Cheapest first; among equal prices, more stock, then the configured order.
            ranked.append((price, -_STOCK_RANK.get(stock.availability, 0), index, candidate))
        if not ranked:
            return _Choice(
                [], f"RunPod has no stock for gpu={spec.gpu} ({', '.join(no_stock)})", no_stock=True
            )
        return _Choice([c for *_, c in sorted(ranked, key=lambda r: r[:3])])

    async def _gpu_catalog(self) -> list[GpuStock] | None:
        """The catalog, cached for RUNPOD_CATALOG_TTL_SECONDS. Concurrent callers share one
        fetch in flight (with a TTL of 0, 50 parallel acquires still cost one call per
        burst, not 50 calls one after another)."""
        if self.api == "graphql":
            return None
        cached = self._catalog
        if cached is not None and time.monotonic() - cached[0] <= self.catalog_ttl:
            return cached[1]
        fetch = self._catalog_fetch
        if fetch is None or fetch.done():
            fetch = self._catalog_fetch = asyncio.ensure_future(self._fetch_catalog())
            fetch.add_done_callback(_retrieve)
        # Shielded: a caller cancelled (provision timeout) does not cancel the others' fetch.
        return await asyncio.shield(fetch)

    async def _fetch_catalog(self) -> list[GpuStock]:
        started = time.monotonic()
        try:
            catalog = await self.client.gpu_catalog() or []
        except RunPodError as exc:
            self._note(exc)
            raise
        self._catalog = (started, catalog)
        return catalog

    # --- pods ----------------------------------------------------------------------------

    def _pod_request(self, spec: WorkerSpec, name: str, candidate: Candidate) -> PodRequest:
        # Pods have no labels: the markers reconciliation needs travel in the env.
        markers = {"OPENALICE_SCHEDULER_INSTANCE": self.instance}
        if spec.store_id is not None:
            markers[STORE_ENV] = spec.store_id
        env = worker_env(spec, markers)
        template = self.templates[spec.kind]
        return PodRequest(
            name=name,
            env=env,
            ports=[f"{self.ports[spec.kind]}/http"],
            image=None if template else self.images[spec.kind],
            template_id=template,
            gpu_type_id=candidate.gpu_type_id,
            cpu_flavor=self.cpu_flavor,
            cloud=self.cloud,
            data_center_ids=candidate.data_center_ids,
            disk_gb=self.disk_gb,
        )

    async def _create(self, request: PodRequest) -> Pod:
        """Create one pod. After an answer that leaves it unknown whether the pod was
        made (5xx, timeout), look it up by name before creating again: never two pods."""
        for attempt in range(1, _CREATE_ATTEMPTS + 1):
            try:
                return await self.client.create_pod(request)
            except RunPodError as exc:
                self._note(exc)
                if not exc.uncertain or attempt == _CREATE_ATTEMPTS:
                    raise
                log.info(
                    "RunPod create of %s failed (%s); looking it up before retrying",
                    request.name,
                    exc.kind,
                )
                await asyncio.sleep(0.5 * attempt)
                existing = await self._find(request.name)
                if existing is not None:
                    return existing
        raise AssertionError("unreachable")

    async def _find(self, name: str) -> Pod | None:
        """The pod with this name; duplicates (names are not unique) are terminated."""
        pods = [
            p for p in await self.client.list_pods() if p.name == name and p.status != "TERMINATED"
        ]
        if not pods:
            return None
        for extra in pods[1:]:
            log.warning("terminating duplicate pod %s of %s", extra.id, name)
            await self.client.terminate_pod(extra.id)
        return pods[0]

    async def _wait_running(self, pod: Pod, spec: WorkerSpec) -> str:
        """Wait until the pod is RUNNING; the service bounds the whole provision. Every
        starting pod of this provider is watched by one loop (starting.py), so 50 pods
        starting at once cost one list call per round, not 50 reads."""
        current = await self.starting.settled(pod.id)
        if current is None:
            raise ProviderError(f"RunPod pod {pod.id} disappeared while starting")
        if current.dead:
            try:
                await self.client.terminate_pod(pod.id)
            except RunPodError as exc:
                # The service's clean-up (by name) and the reconciler try again.
                log.warning("could not terminate dead pod %s yet: %s", pod.id, exc.detail)
            raise ProviderError(f"RunPod pod {pod.id} ended as {current.status} while starting")
        return self.proxy_url.format(pod_id=pod.id, port=self.ports[spec.kind])

    # --- errors --------------------------------------------------------------------------

    def _lease_of(self, pod: Pod) -> str | None:
        if not pod.name.startswith(self.prefix):
            return None
        lease_id = pod.name[len(self.prefix) :]
        try:
            uuid.UUID(lease_id)
        except ValueError:
            return None
        return lease_id

    def _key_rejected(self) -> bool:
        at = self._key_rejected_at
        return at is not None and time.monotonic() - at < _KEY_RECHECK_S

    def _note(self, exc: RunPodError) -> None:
        if exc.kind == ErrorKind.unauthorized:
            self._key_rejected_at = time.monotonic()

    def _describe(self, exc: RunPodError) -> str:
        if exc.kind == ErrorKind.unauthorized:
            return "RunPod rejected RUNPOD_API_KEY (401)"
        if exc.kind == ErrorKind.payment:
            return f"RunPod balance too low (402): {exc.detail}"
        if exc.kind == ErrorKind.unreachable:
            return f"RunPod API unreachable: {exc.detail}"
        status = f" ({exc.status})" if exc.status else ""
        return f"RunPod {exc.kind}{status}: {exc.detail}"

    def _provider_error(self, exc: RunPodError) -> ProviderError:
        self._note(exc)
        message = self._describe(exc)
        if exc.kind == ErrorKind.unreachable:
            return ProviderUnavailable(message)
        return ProviderError(
            message,
            transient=exc.kind
            not in (ErrorKind.unauthorized, ErrorKind.payment, ErrorKind.invalid),
        )


def _retrieve(future: asyncio.Future[list[GpuStock]]) -> None:
    """Mark a shared fetch's failure as seen: its callers may all have been cancelled."""
    if not future.cancelled():
        future.exception()


def _in_region(data_center: str, region: str) -> bool:
    """`US` matches `US-TX-3`; `US-TX` matches `US-TX-3`; `US-TX-3` matches itself."""
    return data_center == region or data_center.startswith(region + "-")


def _death(pod: Pod) -> WorkerDeath | None:
    """A pod that stopped for good: EXITED (stopped: RunPod gives no exit code) or ERROR
    (RunPod's words for a pod that failed). RUNNING, PROVISIONING and STARTING live on."""
    if pod.status == "EXITED":
        return WorkerDeath(LostCause.exited, None, "RunPod reports the pod EXITED")
    if pod.status == "ERROR":
        return WorkerDeath(LostCause.unknown, None, "RunPod reports the pod in ERROR")
    return None
