"""Workers on Modal (docs/backends/modal.md#workers-on-modal): a lease is a Modal Sandbox, made
through the official `modal` client.

- The sandbox runs the kind's image (a registry reference) with the kind's command
  (Modal runs no CMD of an image), its GPU type per GPU class (MODAL_GPU_TYPES; `none`
  on CPU), the worker's environment as a Modal secret (never on a command line), and
  the kind's port exposed through an encrypted tunnel: the lease's endpoint is the
  tunnel's URL, where it is probed too.
- Its tags name the scheduler instance, the state store and the lease, so that
  reconciliation, the orphan sweep and a release cut short find this scheduler's own
  sandboxes with `Sandbox.list(tags=…)`; its name is made of the lease id, so that a
  create retried (a transport error, a restarted scheduler) never makes a second one.
- Its `timeout` is MODAL_SANDBOX_TIMEOUT_SECONDS: Modal's own servers end it then, even
  when no scheduler and no guard runs. A lease on Modal lives at most that long from
  its creation, renewals included (`max_lifetime_seconds`: a renewal past it is a 409).
- A sandbox Modal cannot place yet is queued, not refused
  (docs/backends/modal.md#queued-sandboxes-and-the-start-timeout): the wait for it to
  start and report its tunnel is bounded by MODAL_START_TIMEOUT_SECONDS, and by the
  provision timeout less a margin (a `tunnels()` call never holds longer); past the
  bound it is terminated and the reason names the wait. Still queued, or Modal's
  "no capacity", is ProviderOutOfCapacity (the next provider is tried); any other
  refusal a ProviderError.
  The client retries transient gRPC errors itself (with backoff); a release is
  idempotent (a sandbox already ended, or unknown, is gone).
- The kinds' images are resolved ahead of any acquire (images.py).

MODAL_TOKEN_SECRET is given to the client only: no message here carries it."""

from __future__ import annotations

import asyncio
import logging
import math
import shlex
import time
from collections.abc import Mapping, Sequence
from typing import Any

import modal
import modal.exception

from openalice_scheduler.config import Settings
from openalice_scheduler.errors import ProviderError, ProviderOutOfCapacity
from openalice_scheduler.models import GpuClass, LostCause
from openalice_scheduler.prices import parse_prices
from openalice_scheduler.providers.base import (
    Availability,
    ProviderStatus,
    Worker,
    WorkerDeath,
    WorkerInfo,
    WorkerSpec,
    lease_bound,
    past_bound,
    worker_env,
)
from openalice_scheduler.providers.modal.images import ImageResolver

log = logging.getLogger(__name__)

# A sandbox ended by its `timeout` has this return code (modal's `_result_returncode`).
MODAL_TIMEOUT_RETURNCODE = 124
# The tags every sandbox of this scheduler carries.
TAG_INSTANCE = "openalice_instance"
TAG_STORE = "openalice_store"
TAG_LEASE = "openalice_lease"
# What the wait for a start keeps back of the provision timeout: the time to terminate
# the sandbox given up, so that the reason given is this provider's, not the service's
# "no worker after N s" (at most a quarter of a short provision timeout).
CLEAN_UP_MARGIN_S = 5.0
# The longest one `tunnels()` call asks the server to hold (Modal's long polls last
# under a minute; the client's default is 50).
TUNNELS_POLL_S = 50


class ModalProvider:
    name = "modal"
    resource_label = "sandboxes"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.max_workers = settings.modal_max_sandboxes
        # Modal ends a sandbox at its timeout, counted from its creation.
        self.max_lifetime_seconds = lease_bound(settings.modal_sandbox_timeout_seconds, settings)
        self.instance = settings.scheduler_instance
        self.prices = parse_prices(settings.modal_price_per_hour)
        self.commands = {
            "renderer": shlex.split(settings.modal_renderer_command),
            "anim": shlex.split(settings.modal_anim_command),
        }
        self.ports = settings.worker_ports
        self.images = ImageResolver(
            {"renderer": settings.modal_renderer_image, "anim": settings.modal_anim_image},
            settings.modal_registry_secret,
        )
        self._client: modal.Client | None = None
        self._app: modal.App | None = None

    # --- the client and the app ------------------------------------------------------

    async def _connect(self) -> tuple[modal.Client, modal.App]:
        """The client and the app (MODAL_APP_NAME, looked up or created), once; then the
        images' resolution starts, in the background."""
        if self._client is None or self._app is None:
            secret = self.settings.modal_token_secret
            assert self.settings.modal_token_id and secret, "configuration_problems checked it"
            try:
                client = await modal.Client.from_credentials.aio(
                    self.settings.modal_token_id, secret.get_secret_value()
                )
                app = await modal.App.lookup.aio(
                    self.settings.modal_app_name, create_if_missing=True, client=client
                )
            except modal.exception.Error as exc:
                raise _error("connecting to Modal", exc) from None
            self._client, self._app = client, app
            self.images.start(client, app)
        return self._client, self._app

    # --- the Provider contract -----------------------------------------------------------

    def exclusive_resources(self, spec: WorkerSpec) -> Sequence[str] | None:
        return None

    def gpu_type(self, gpu: GpuClass) -> str | None:
        return None if gpu == GpuClass.none else self.settings.modal_gpu_type(gpu.value)

    async def available(self, spec: WorkerSpec) -> Availability:
        if (too_long := past_bound(spec, self, "MODAL_SANDBOX_TIMEOUT_SECONDS")) is not None:
            return too_long
        if spec.region is not None:
            return Availability(False, "modal serves no region (leave region unset)")
        if spec.gpu != GpuClass.none and self.gpu_type(spec.gpu) is None:
            return Availability(False, f"MODAL_GPU_TYPES names no GPU type for gpu={spec.gpu}")
        if self._client is not None and self._app is not None:
            problem = self.images.problem(spec.kind.value, self._client, self._app)
            if problem is not None:
                return Availability(False, problem)
        return Availability(True)

    async def provision(self, spec: WorkerSpec) -> Worker:
        client, app = await self._connect()
        kind = spec.kind.value
        port = self.ports[kind]
        gpu = self.gpu_type(spec.gpu)
        tags = {TAG_INSTANCE: self.instance, TAG_LEASE: spec.lease_id}
        if spec.store_id:
            tags[TAG_STORE] = spec.store_id
        bound, setting = self._start_bound()
        deadline = time.monotonic() + bound
        sandbox: Any = None
        image: modal.Image | None = None
        try:
            async with asyncio.timeout(bound):
                image = await self._image(kind)
                env = modal.Secret.from_dict(dict(worker_env(spec)))
                # Returns once Modal placed the sandbox (GPU: the client waits for its
                # task), or at once with the sandbox still queued (the tunnel waits).
                sandbox = await modal.Sandbox.create.aio(
                    *self.commands[kind],
                    app=app,
                    name=self.sandbox_name(spec.lease_id),
                    tags=tags,
                    image=image,
                    secrets=[env],
                    gpu=gpu,
                    timeout=self.settings.modal_sandbox_timeout_seconds,
                    encrypted_ports=[port],
                    client=client,
                )
                url = await _tunnel_url(sandbox, port, deadline)
        except TimeoutError:
            # The client terminates a sandbox whose create it gave up; whatever else
            # carries the lease's tag (a create answered, still queued) goes too.
            await self._terminate_quietly(spec.lease_id)
            if image is None:
                raise ProviderError(
                    f"modal: the image of {kind} was still being resolved after {bound:g} s "
                    f"({setting})"
                ) from None
            raise self._not_started(spec, sandbox, port, bound, setting) from None
        except modal.exception.ResourceExhaustedError:
            raise ProviderOutOfCapacity(f"Modal has no capacity for gpu={spec.gpu}") from None
        except modal.exception.Error as exc:
            if sandbox is None:
                raise _error("creating the sandbox", exc) from None
            await self._terminate_quietly(spec.lease_id)
            raise _error(f"asking sandbox {sandbox.object_id}'s tunnel", exc) from None
        except KeyError:
            await self._terminate_quietly(spec.lease_id)
            raise ProviderError(
                f"Modal sandbox {sandbox.object_id} has no tunnel to port {port}"
            ) from None
        log.info("lease %s: Modal sandbox %s, gpu=%s", spec.lease_id, sandbox.object_id, gpu)
        return Worker(
            endpoint=url,
            provider_token=sandbox.object_id,
            probe_url=url,
            behind_proxy=True,
            gpu_type=gpu,
            price_per_hour=self.prices.get(spec.gpu.value),
        )

    async def release(self, provider_token: str, lease_id: str) -> None:
        if provider_token:
            await self._terminate(provider_token)
            return
        # A provision cut short: whatever sandbox carries the lease's tag.
        for sandbox in await self._list({TAG_LEASE: lease_id}):
            await self._terminate(sandbox.object_id)

    async def list_workers(self) -> Mapping[str, list[WorkerInfo]] | None:
        found: dict[str, list[WorkerInfo]] = {}
        for sandbox in await self._list({}):
            try:
                tags = await sandbox.get_tags.aio()
                ended = await sandbox.poll.aio()
            except modal.exception.NotFoundError:
                continue  # gone meanwhile
            except modal.exception.Error as exc:
                raise _error("listing sandboxes", exc) from None
            lease_id = tags.get(TAG_LEASE)
            if lease_id is None:
                continue
            found.setdefault(lease_id, []).append(
                WorkerInfo(
                    lease_id=lease_id,
                    provider_token=sandbox.object_id,
                    store_id=tags.get(TAG_STORE),
                    death=None if ended is None else _death(ended),
                )
            )
        return found

    async def death_of(self, provider_token: str) -> WorkerDeath | None:
        """How a sandbox no longer listed ended (Modal lists running sandboxes only):
        its return code, read by `poll()`; None while it still runs."""
        client, _ = await self._connect()
        try:
            sandbox = await modal.Sandbox.from_id.aio(provider_token, client=client)
            code = await sandbox.poll.aio()
        except modal.exception.NotFoundError:
            return WorkerDeath(LostCause.unknown, None, "Modal no longer knows the sandbox")
        except modal.exception.Error as exc:
            raise _error(f"reading sandbox {provider_token}", exc) from None
        return None if code is None else _death(code)

    async def price(self, spec: WorkerSpec) -> float | None:
        return self.prices.get(spec.gpu.value)

    async def status(self) -> ProviderStatus:
        try:
            await self._connect()
        except ProviderError as exc:
            return ProviderStatus(False, exc.message)
        capacity: dict[str, int | None] = {
            gpu.value: (self.max_workers or None)
            for gpu in GpuClass
            if gpu == GpuClass.none or self.gpu_type(gpu) is not None
        }
        return ProviderStatus(True, "", capacity)

    async def close(self) -> None:
        await self.images.close()
        if self._client is not None:
            await self._client.close.aio()
            self._client = None

    # --- helpers -------------------------------------------------------------------------

    def sandbox_name(self, lease_id: str) -> str:
        """The sandbox's name in the app: one per lease, so that a retried create is
        refused instead of making a second sandbox (the lease id whole: at most 60
        characters, under Modal's 64)."""
        return f"oa-{self.instance[:20]}-{lease_id}"

    def _start_bound(self) -> tuple[float, str]:
        """How long a new sandbox may take to start and report its tunnel, and the
        setting that says so: MODAL_START_TIMEOUT_SECONDS, unless the provision timeout
        less the margin to clean up is shorter."""
        provision = self.settings.provision_timeout_seconds
        budget = provision - min(CLEAN_UP_MARGIN_S, provision / 4)
        start = self.settings.modal_start_timeout_seconds
        if start <= budget:
            return start, "MODAL_START_TIMEOUT_SECONDS"
        return budget, f"PROVISION_TIMEOUT_SECONDS ({provision:g} s) less time to clean up"

    async def _image(self, kind: str) -> modal.Image:
        try:
            return await self.images.image(kind)
        except LookupError as exc:
            raise ProviderError(str(exc)) from None

    def _not_started(
        self, spec: WorkerSpec, sandbox: Any, port: int, bound: float, setting: str
    ) -> ProviderError:
        """Why a sandbox given up after `bound` seconds was: still queued by Modal for
        want of capacity (a 503 reason: the next provider is tried), or, once the
        create was answered, queued still or without its tunnel."""
        waited = f"within {bound:g} s ({setting}); terminated"
        if sandbox is None:
            what = f"gpu={spec.gpu.value}" + (
                f" ({self.gpu_type(spec.gpu)})" if spec.gpu != GpuClass.none else ""
            )
            return ProviderOutOfCapacity(
                f"modal: the sandbox was not started {waited}: queued by Modal for want "
                f"of capacity for {what}"
            )
        message = (
            f"modal: sandbox {sandbox.object_id} did not report a tunnel to port {port} "
            f"{waited}: still queued by Modal, or its tunnel never came"
        )
        if setting == "MODAL_START_TIMEOUT_SECONDS":
            return ProviderOutOfCapacity(message)
        return ProviderError(message)

    async def _terminate_quietly(self, lease_id: str) -> None:
        """Terminate what carries the lease's tag; what cannot be now is left to the
        service's own clean-up and the reconciler (it carries our tags)."""
        try:
            await self.release("", lease_id)
        except ProviderError as exc:
            log.warning("lease %s: a sandbox given up is not terminated yet: %s", lease_id, exc)

    async def _list(self, tags: dict[str, str]) -> list[Any]:
        client, app = await self._connect()
        try:
            return [
                sandbox
                async for sandbox in modal.Sandbox.list.aio(
                    app_id=app.app_id, tags={TAG_INSTANCE: self.instance, **tags}, client=client
                )
            ]
        except modal.exception.Error as exc:
            raise _error("listing sandboxes", exc) from None

    async def _terminate(self, sandbox_id: str) -> None:
        """End the sandbox; one already ended, or unknown to Modal, is gone: success."""
        client, _ = await self._connect()
        try:
            sandbox = await modal.Sandbox.from_id.aio(sandbox_id, client=client)
            await sandbox.terminate.aio()
        except modal.exception.NotFoundError:
            return
        except modal.exception.Error as exc:
            raise _error(f"terminating sandbox {sandbox_id}", exc) from None


async def _tunnel_url(sandbox: Any, port: int, deadline: float) -> str:
    """The URL of the sandbox's tunnel to `port`, once Modal reports it (once the
    sandbox runs), asked in long polls that end by `deadline` (monotonic): the client's
    default of 50 s per call would outlast a shorter bound. KeyError: no such tunnel."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        try:
            wait = max(1, min(TUNNELS_POLL_S, math.ceil(remaining)))
            tunnels = await sandbox.tunnels.aio(timeout=wait)
        except modal.exception.SandboxTimeoutError:
            continue  # not running yet: ask again until the deadline
        return str(tunnels[port].url)


def _error(doing: str, exc: BaseException) -> ProviderError:
    """A ProviderError for a failed Modal call: its type and message (the client's
    messages name the call and Modal's answer, never the token)."""
    return ProviderError(f"modal: {doing}: {type(exc).__name__}: {str(exc)[:200]}")


def _death(returncode: int) -> WorkerDeath:
    """How a sandbox ended, from its return code, all the client tells (modal 1.6.4,
    `Sandbox.returncode`): 124 its `timeout` (Modal's own deadline); 137 a SIGKILL, by a
    terminate or by the OOM killer, which the client does not tell apart; else its
    process's exit code."""
    if returncode == MODAL_TIMEOUT_RETURNCODE:
        return WorkerDeath(LostCause.deadline, returncode, "the sandbox reached its timeout")
    return WorkerDeath(LostCause.exited, returncode, f"the sandbox ended with code {returncode}")
