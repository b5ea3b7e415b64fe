"""Workers on Kubernetes (docs/backends/kubernetes.md#workers-on-kubernetes): a lease is a Pod, made
through lightkube's async client, configured the Kubernetes way (the pod's service account when the
scheduler runs in a cluster, else KUBECONFIG and K8S_CONTEXT).

- The pod (objects.py) runs the kind's image, never restarted, with the GPU class's
  extended resource as its limit and its node selector (K8S_GPU_CLASSES); the worker's
  environment is a Secret of the pod's name, owned by the pod (removed with it by
  Kubernetes' garbage collector), never in the pod spec. The pod's name is made of the
  lease id: a create retried after a lost answer, or by a restarted scheduler, finds the
  lease's one pod (409) instead of making a second.
- The endpoint is `http://<pod IP>:<port>`, for callers in the cluster; the provision
  returns once the pod is Running and Ready, and the service then probes it too.
- The deadline lives in the kubelet: `activeDeadlineSeconds` is K8S_POD_DEADLINE_SECONDS,
  counted from the pod's start, so the kubelet ends it even when no scheduler and no
  guard runs. Kubernetes lets a running pod's deadline be lowered, never raised: a
  lease on Kubernetes lives at most that long from its creation, renewals included
  (`max_lifetime_seconds`; a renewal past it is a 409), as on Modal.
- A pod still unschedulable after K8S_SCHEDULE_TIMEOUT_SECONDS (K8S_SCALE_UP_TIMEOUT_SECONDS
  when the cluster autoscaler triggered a scale-up for it; at once when it says it cannot
  help) is deleted and the acquire goes to the next provider (ProviderOutOfCapacity, in
  the scheduler's and autoscaler's words); an image pull is given up when its reason is
  final or after K8S_IMAGE_PULL_TIMEOUT_SECONDS (starting.py). Transient API errors (429,
  5xx, a dropped connection) are retried with backoff (stamina); what is still refused
  then ends the attempt as a reason of the 503 (ProviderOutOfCapacity); 404 on delete
  is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from pathlib import Path
from typing import Any, TypeVar

import httpx
import stamina
from lightkube import AsyncClient, ConfigError, KubeConfig
from lightkube.config.kubeconfig import DEFAULT_KUBECONFIG, SERVICE_ACCOUNT, SingleConfig
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Event, Pod, Secret

from openalice_scheduler.config import Settings
from openalice_scheduler.config.kubernetes import parse_gpu_classes
from openalice_scheduler.config.kubernetes_pods import with_gpu_labels
from openalice_scheduler.errors import ProviderError, ProviderOutOfCapacity
from openalice_scheduler.models import GpuClass
from openalice_scheduler.prices import parse_prices
from openalice_scheduler.providers.base import (
    Availability,
    ProviderStatus,
    Resync,
    Worker,
    WorkerEnded,
    WorkerInfo,
    WorkerSpec,
    lease_bound,
    past_bound,
    worker_env,
)
from openalice_scheduler.providers.kubernetes import objects, podspec, starting, watching
from openalice_scheduler.providers.kubernetes.objects import (
    LABEL_GPU,
    LABEL_INSTANCE,
    LABEL_KIND,
    LABEL_LEASE,
    LABEL_MANAGED_BY,
    LABEL_STORE,
    MANAGED_BY,
    PodPlan,
)
from openalice_scheduler.providers.kubernetes.watching import (
    on_watch_error,
    refusal,
    status_code,
    transient,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
# The labels of the node's GPU product (NVIDIA's GPU feature discovery; GKE's
# accelerator), when a class's node selector names one: recorded as the lease's gpu_type.
GPU_PRODUCT_LABELS = ("nvidia.com/gpu.product", "cloud.google.com/gke-accelerator")


def config_given() -> bool:
    """Whether the Kubernetes way of finding a cluster has anything to find: the pod's
    service account, KUBECONFIG, or the default file."""
    account = Path(SERVICE_ACCOUNT, "token")
    default = Path(DEFAULT_KUBECONFIG).expanduser()
    return account.is_file() or bool(os.environ.get("KUBECONFIG")) or default.is_file()


def load_config(settings: Settings) -> SingleConfig:
    """The cluster and credentials: the pod's service account in a cluster (K8S_CONTEXT
    does not apply there), else the kubeconfig file (KUBECONFIG, or ~/.kube/config) at
    K8S_CONTEXT or its current context; KUBECONFIG may list several files, merged as
    kubectl merges them. ConfigError saying why not."""
    from openalice_scheduler.providers.kubernetes.kubeconfig import load_kubeconfig, select

    try:
        config = KubeConfig.from_service_account()
        context = None
    except ConfigError:
        config = load_kubeconfig(os.environ.get("KUBECONFIG") or DEFAULT_KUBECONFIG)
        context = settings.k8s_context
    return select(config, context)


class KubernetesProvider:
    name = "kubernetes"
    resource_label = "pods"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.namespace = settings.k8s_namespace
        self.max_workers = settings.k8s_max_pods
        # The kubelet ends a pod at its deadline, counted from the pod's start.
        self.max_lifetime_seconds = lease_bound(settings.k8s_pod_deadline_seconds, settings)
        self.instance = settings.scheduler_instance
        self.prices = parse_prices(settings.k8s_price_per_hour)
        # Per GPU class its resource and node selector, read once (`none`: never named).
        self.gpu_classes = with_gpu_labels(
            parse_gpu_classes(settings.k8s_gpu_classes), settings.k8s_gpu_labels
        )
        self.shape = podspec.PodShape.from_settings(settings)
        self.images = {"renderer": settings.k8s_renderer_image, "anim": settings.k8s_anim_image}
        self.ports = settings.worker_ports
        self.limits = starting.Limits(
            schedule=settings.k8s_schedule_timeout_seconds,
            scale_up=settings.k8s_scale_up_timeout_seconds,
            image_pull=settings.k8s_image_pull_timeout_seconds,
        )
        self._client: AsyncClient | None = None

    # --- the Provider contract -----------------------------------------------------------

    def exclusive_resources(self, spec: WorkerSpec) -> Sequence[str] | None:
        return None

    def serves(self, gpu: GpuClass) -> bool:
        return gpu == GpuClass.none or gpu.value in self.gpu_classes

    async def available(self, spec: WorkerSpec) -> Availability:
        if (too_long := past_bound(spec, self, "K8S_POD_DEADLINE_SECONDS")) is not None:
            return too_long
        if spec.region is not None and spec.region != self.settings.k8s_region:
            served = self.settings.k8s_region
            return Availability(
                False,
                f"kubernetes serves region {served}"
                if served
                else "kubernetes serves no region (K8S_REGION is unset)",
            )
        if not self.serves(spec.gpu):
            return Availability(False, f"K8S_GPU_CLASSES names no resource for gpu={spec.gpu}")
        return Availability(True)

    async def provision(self, spec: WorkerSpec) -> Worker:
        plan = self.plan(spec)
        created = await self._create_pod(plan, spec.lease_id)
        try:
            assert created.metadata is not None and created.metadata.uid is not None
            await self._create_secret(objects.secret(plan, created.metadata.uid, worker_env(spec)))
            ip = await self._wait_ready(created)
        except BaseException:
            # Nothing half-made is left that this call knows of (the service's release
            # after a failed provision tries again, should the API be away now).
            with contextlib.suppress(ProviderError):
                await asyncio.shield(self._delete(plan.name, grace=0))
            raise
        endpoint = f"http://{ip}:{plan.port}"
        log.info(
            "lease %s: Kubernetes pod %s/%s at %s", spec.lease_id, self.namespace, plan.name, ip
        )
        return Worker(
            endpoint=endpoint,
            provider_token=plan.name,
            probe_url=endpoint,
            gpu_type=_gpu_type(plan),
            price_per_hour=self.prices.get(spec.gpu.value),
        )

    async def release(self, provider_token: str, lease_id: str) -> None:
        if provider_token:
            await self._delete(provider_token)
            return
        # A provision cut short: whatever pod carries the lease's label.
        for pod in await self._list({LABEL_LEASE: lease_id}):
            assert pod.metadata is not None and pod.metadata.name is not None
            await self._delete(pod.metadata.name)

    async def list_workers(self) -> Mapping[str, list[WorkerInfo]] | None:
        found: dict[str, list[WorkerInfo]] = {}
        for pod in await self._list({}):
            meta = pod.metadata
            assert meta is not None and meta.name is not None
            lease_id = (meta.labels or {}).get(LABEL_LEASE)
            if lease_id is None:
                continue
            found.setdefault(lease_id, []).append(
                WorkerInfo(
                    lease_id=lease_id,
                    provider_token=meta.name,
                    store_id=(meta.labels or {}).get(LABEL_STORE),
                    death=objects.death(pod),
                    ending=meta.deletionTimestamp is not None,
                )
            )
        return found

    def watch(self) -> AsyncIterator[WorkerEnded | Resync]:
        """The deaths of this scheduler's pods, from one watch (watching.py)."""
        return watching.deaths(self._connect, self.namespace, self.instance)

    async def price(self, spec: WorkerSpec) -> float | None:
        return self.prices.get(spec.gpu.value)

    async def status(self) -> ProviderStatus:
        try:
            pods = await self._list({})
        except ProviderError as exc:
            return ProviderStatus(False, exc.message)
        capacity: dict[str, int | None] = {
            gpu.value: (self.max_workers or None) for gpu in GpuClass if self.serves(gpu)
        }
        detail = f"{len(pods)} pods in namespace {self.namespace}"
        return ProviderStatus(True, detail, capacity)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    # --- the pod -------------------------------------------------------------------------

    def pod_name(self, lease_id: str) -> str:
        """The lease's pod (and Secret): one per lease, so that a create retried finds it
        (a DNS-1123 name: the instance and the lease id, at most 79 characters)."""
        return f"oa-{self.instance}-{lease_id.lower()}"

    def plan(self, spec: WorkerSpec) -> PodPlan:
        kind = spec.kind.value
        labels = {
            LABEL_MANAGED_BY: MANAGED_BY,
            LABEL_INSTANCE: self.instance,
            LABEL_LEASE: spec.lease_id,
            LABEL_KIND: kind,
            LABEL_GPU: spec.gpu.value,
        }
        if spec.store_id:
            labels[LABEL_STORE] = spec.store_id
        return PodPlan(
            name=self.pod_name(spec.lease_id),
            namespace=self.namespace,
            labels=labels,
            image=self.images[kind],
            port=self.ports[kind],
            gpu=self.gpu_classes.get(spec.gpu.value),
            deadline_seconds=self.settings.k8s_pod_deadline_seconds,
            grace_seconds=self.settings.k8s_termination_grace_seconds,
            fit=podspec.fit(self.shape, kind, spec.gpu.value, spec.priority_class),
        )

    async def _create_pod(self, plan: PodPlan, lease_id: str) -> Pod:
        client = self._connect()
        try:
            return await self._call(lambda: client.create(objects.pod(plan)))
        except httpx.TransportError as exc:
            raise _refused(f"creating pod {plan.name}", exc) from None
        except ApiError as exc:
            if exc.status.code != 409:
                raise _refused(f"creating pod {plan.name}", exc) from None
        # A create answered before (its answer lost) or by another attempt: the lease's pod.
        found = await self._get(plan.name)
        labels = (found.metadata.labels or {}) if found and found.metadata else {}
        if found is None or labels.get(LABEL_LEASE) != lease_id:
            raise ProviderError(f"kubernetes: pod {plan.name} exists and is not this lease's")
        return found

    async def _create_secret(self, obj: Secret) -> None:
        client = self._connect()
        try:
            await self._call(lambda: client.create(obj))
        except httpx.TransportError as exc:
            raise _refused("creating the worker's secret", exc) from None
        except ApiError as exc:
            if exc.status.code != 409:  # 409: made by an earlier try of this very call
                # The API's message may quote what was sent: only its reason is told.
                raise ProviderOutOfCapacity(
                    f"creating the worker's secret: {exc.status.code} {exc.status.reason}"
                ) from None

    async def _wait_ready(self, created: Pod) -> str:
        """The pod's IP once it is Running and Ready (starting.py: the schedule, scale-up
        and image-pull bounds); any refusal of the API on the way ends the attempt."""
        assert created.metadata is not None and created.metadata.name is not None
        name = created.metadata.name
        changes = starting.NextChange(self._changes(name, created.metadata.resourceVersion))
        try:
            return await starting.wait_ready(
                created, changes, lambda: self._pod_events(name), self.limits
            )
        finally:
            await changes.close()

    async def _changes(self, name: str, version: str | None) -> AsyncGenerator[Pod | None, None]:
        """The pod each time it changes after `version` (None once it is deleted), from a
        watch; a transient error is retried from the last version heard (lightkube), and
        a version too old to watch from (410 Gone) is read again and watched from there."""
        client = self._connect()
        while True:
            try:
                async for kind, pod in client.watch(
                    Pod,
                    namespace=self.namespace,
                    fields={"metadata.name": name},
                    resource_version=version,
                    on_error=on_watch_error,
                ):
                    yield None if kind == "DELETED" else pod
                return  # not reached: lightkube watches again when the server ends a watch
            except httpx.HTTPError as exc:  # lightkube's ApiError, a refused watch, a drop
                if not isinstance(exc, httpx.HTTPStatusError) or status_code(exc) != 410:
                    raise _refused(f"watching pod {name}", exc) from None
            again = await self._get(name)
            yield again
            if again is None or again.metadata is None:
                return
            version = again.metadata.resourceVersion

    # --- API calls -----------------------------------------------------------------------

    def _connect(self) -> AsyncClient:
        if self._client is None:
            try:
                config = load_config(self.settings)
            except ConfigError as exc:
                raise ProviderError(f"kubernetes: configuration: {exc}") from None
            self._client = AsyncClient(
                config=config,
                namespace=self.namespace,
                field_manager=MANAGED_BY,
                timeout=httpx.Timeout(15.0),
                trust_env=False,
            )
        return self._client

    async def _call(self, call: Callable[[], Awaitable[T]]) -> T:
        """One API call, tried again with backoff while it fails transiently."""
        async for attempt in stamina.retry_context(
            on=transient, attempts=6, timeout=30.0, wait_initial=0.1, wait_max=2.0
        ):
            with attempt:
                return await call()
        raise AssertionError("unreachable: retry_context raises its last error")

    async def _get(self, name: str) -> Pod | None:
        client = self._connect()
        try:
            return await self._call(lambda: client.get(Pod, name, namespace=self.namespace))
        except ApiError as exc:
            if exc.status.code == 404:
                return None
            raise _refused(f"reading pod {name}", exc) from None
        except httpx.TransportError as exc:
            raise _refused(f"reading pod {name}", exc) from None

    async def _pod_events(self, name: str) -> list[Event]:
        """The events of the pod `name` (the cluster autoscaler's among them)."""
        client = self._connect()
        fields: dict[str, Any] = {"involvedObject.kind": "Pod", "involvedObject.name": name}

        async def listed() -> list[Event]:
            return [e async for e in client.list(Event, namespace=self.namespace, fields=fields)]

        try:
            return await self._call(listed)
        except (ApiError, httpx.TransportError) as exc:
            raise _refused(f"reading pod {name}'s events", exc) from None

    async def _list(self, labels: dict[str, str]) -> list[Pod]:
        client = self._connect()
        selector: dict[str, Any] = {LABEL_INSTANCE: self.instance, **labels}

        async def listed() -> list[Pod]:
            return [
                pod async for pod in client.list(Pod, namespace=self.namespace, labels=selector)
            ]

        try:
            return await self._call(listed)
        except (ApiError, httpx.TransportError) as exc:
            raise _error("listing pods", exc) from None

    async def _delete(self, name: str, grace: int | None = None) -> None:
        """Delete the pod (with its own grace period unless `grace` is given) and its
        Secret; one already gone is success."""
        for resource in (Pod, Secret):
            await self._delete_one(resource, name, grace)

    async def _delete_one(
        self, resource: type[Pod] | type[Secret], name: str, grace: int | None
    ) -> None:
        client = self._connect()
        doing = f"deleting {resource.__name__.lower()} {name}"
        try:
            await self._call(
                lambda: client.delete(resource, name, namespace=self.namespace, grace_period=grace)
            )
        except ApiError as exc:
            if exc.status.code != 404:
                raise _error(doing, exc) from None
        except httpx.TransportError as exc:
            raise _error(doing, exc) from None


def _error(doing: str, exc: httpx.HTTPError) -> ProviderError:
    """A ProviderError for a failed API call: its status and the API's message (the
    client's messages never carry the credentials)."""
    return ProviderError(f"kubernetes: {doing}: {refusal(exc)}")


def _refused(doing: str, exc: httpx.HTTPError) -> ProviderOutOfCapacity:
    """A call or watch of a provision the API refused (or could not be reached for),
    after its retries: the attempt ends and the next provider is tried, with this reason
    in the 503's `reasons` when none serves (docs/backends/kubernetes.md#errors)."""
    return ProviderOutOfCapacity(f"{doing}: {refusal(exc)}")


def _gpu_type(plan: PodPlan) -> str | None:
    selector = plan.gpu.node_selector if plan.gpu else {}
    return next((selector[k] for k in GPU_PRODUCT_LABELS if k in selector), None)
