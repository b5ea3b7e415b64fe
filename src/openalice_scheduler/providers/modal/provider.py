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
- Modal's "no capacity" is ProviderOutOfCapacity (the next provider is tried); any other
  refusal a ProviderError. The client retries transient gRPC errors itself (with
  backoff); a release is idempotent (a sandbox already ended, or unknown, is gone).

MODAL_TOKEN_SECRET is given to the client only: no message here carries it."""

from __future__ import annotations

import logging
import shlex
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

log = logging.getLogger(__name__)

# A sandbox ended by its `timeout` has this return code (modal's `_result_returncode`).
MODAL_TIMEOUT_RETURNCODE = 124
# The tags every sandbox of this scheduler carries.
TAG_INSTANCE = "openalice_instance"
TAG_STORE = "openalice_store"
TAG_LEASE = "openalice_lease"


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
        self.images = {
            "renderer": settings.modal_renderer_image,
            "anim": settings.modal_anim_image,
        }
        self.commands = {
            "renderer": shlex.split(settings.modal_renderer_command),
            "anim": shlex.split(settings.modal_anim_command),
        }
        self.ports = settings.worker_ports
        self._client: modal.Client | None = None
        self._app: modal.App | None = None

    # --- the client and the app ------------------------------------------------------

    async def _connect(self) -> tuple[modal.Client, modal.App]:
        """The client and the app (MODAL_APP_NAME, looked up or created), once."""
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
        return Availability(True)

    async def provision(self, spec: WorkerSpec) -> Worker:
        client, app = await self._connect()
        kind = spec.kind.value
        port = self.ports[kind]
        gpu = self.gpu_type(spec.gpu)
        tags = {TAG_INSTANCE: self.instance, TAG_LEASE: spec.lease_id}
        if spec.store_id:
            tags[TAG_STORE] = spec.store_id
        try:
            image = modal.Image.from_registry(self.images[kind])
            env = modal.Secret.from_dict(dict(worker_env(spec)))
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
        except modal.exception.ResourceExhaustedError:
            raise ProviderOutOfCapacity(f"Modal has no capacity for gpu={spec.gpu}") from None
        except modal.exception.Error as exc:
            raise _error("creating the sandbox", exc) from None
        try:
            tunnels = await sandbox.tunnels.aio()
            url = tunnels[port].url
        except (modal.exception.Error, KeyError) as exc:
            await self._terminate(sandbox.object_id)
            raise ProviderError(
                f"Modal sandbox {sandbox.object_id} has no tunnel to port {port}: "
                f"{type(exc).__name__}"
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
        if self._client is not None:
            await self._client.close.aio()
            self._client = None

    # --- helpers -------------------------------------------------------------------------

    def sandbox_name(self, lease_id: str) -> str:
        """The sandbox's name in the app: one per lease, so that a retried create is
        refused instead of making a second sandbox (the lease id whole: at most 60
        characters, under Modal's 64)."""
        return f"oa-{self.instance[:20]}-{lease_id}"

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
