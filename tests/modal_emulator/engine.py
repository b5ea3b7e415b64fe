"""A sandbox's life: scheduled, its container started with its tunnels, then ended once.

- Scheduling takes `settings.schedule_delay` seconds (real time); then the container is
  started on the emulator's network and each exposed port gets its tunnel.
- It ends exactly once, by the first of: its process exiting (SUCCESS with exit code 0,
  else FAILURE with the code), `terminate` (TERMINATED: return code 137), its deadline
  `created_at + timeout` on the emulator's clock (TIMEOUT: return code 124), a start
  that failed (FAILURE, with Docker's reason). Its tunnels close and its container is
  removed: an ended sandbox is gone, only its record stays.
- Deadlines are checked every quarter of a second of real time, and at once when the
  clock is moved (`advance_clock`), so a test ends a sandbox by its deadline without
  waiting for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from modal_proto import api_pb2

from .containers import Containers, ContainerSpec
from .state import EmulatorState, GenericStatus, SandboxRecord, new_task_id
from .tls import TunnelCertificates
from .tunnels import open_tunnel

log = logging.getLogger("modal_emulator")
_DEADLINE_CHECK = 0.25


class SandboxEngine:
    def __init__(
        self,
        state: EmulatorState,
        containers: Containers,
        certificates: TunnelCertificates,
        *,
        tunnel_host: str,
        tunnel_bind: str,
    ) -> None:
        self.state = state
        self.containers = containers
        self.tunnel_host = tunnel_host
        self.tunnel_bind = tunnel_bind
        self._tls = certificates.server_context(["http/1.1"])
        self._tls_h2 = certificates.server_context(["h2", "http/1.1"])
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- start and stop ----------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self.containers.ensure_network)
        self.containers.watch_exits(self._exit_heard)
        self._spawn(self._watch_deadlines())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for record in self.state.sandboxes.values():
            for tunnel in record.tunnels:
                await tunnel.close()
        await asyncio.to_thread(self.containers.close)

    def _spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("emulator task failed", exc_info=task.exception())

    # --- a sandbox's life --------------------------------------------------------------

    def admit(self, record: SandboxRecord) -> None:
        """Take a new sandbox in and start scheduling it."""
        self.state.sandboxes[record.sandbox_id] = record
        self._spawn(self._schedule(record))

    async def wait_started(self, record: SandboxRecord, timeout: float | None) -> bool:
        """Wait until its container runs (True) or it ended or `timeout` passed (False)."""
        if record.state == "pending":
            waits = [
                asyncio.ensure_future(record.started.wait()),
                asyncio.ensure_future(record.ended.wait()),
            ]
            try:
                await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in waits:
                    task.cancel()
        return record.state == "running"

    async def wait_ended(self, record: SandboxRecord, timeout: float) -> None:
        if record.state != "ended" and timeout > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(record.ended.wait(), timeout)

    async def _schedule(self, record: SandboxRecord) -> None:
        delay = self.state.settings.schedule_delay
        if delay > 0:
            await asyncio.sleep(delay)
        if record.state == "ended":  # terminated (or past its deadline) before it ran
            return
        task_id = new_task_id(record.api)
        spec = ContainerSpec(
            sandbox_id=record.sandbox_id,
            app_id=record.app_id,
            image=record.image,
            command=record.command,
            env={**self._platform_env(record, task_id), **record.env},
            workdir=record.workdir,
            nano_cpus=int(record.cpu_max * 1e9) if record.cpu_max else None,
            mem_limit_mb=record.memory_max_mb,
        )
        try:
            container_id, address = await asyncio.to_thread(self.containers.run, spec)
        except Exception as exc:  # noqa: BLE001 - Docker's reason becomes the result
            await self.end(record, GenericStatus.GENERIC_STATUS_FAILURE, exception=str(exc))
            return
        # It ran, if only for a moment (a process that exits at once ends it already).
        record.container_id, record.address, record.task_id = container_id, address, task_id
        if record.state == "ended":  # ended while its container was being made
            await asyncio.to_thread(self.containers.remove, container_id)
            return
        for port in record.ports:
            record.tunnels.append(
                await open_tunnel(
                    container_port=port.port,
                    encrypted=port.encrypted,
                    h2=port.h2,
                    target_host=address,
                    host=self.tunnel_host,
                    bind=self.tunnel_bind,
                    tls=self._tls,
                    tls_h2=self._tls_h2,
                )
            )
        if record.state == "ended":
            for tunnel in record.tunnels:
                await tunnel.close()
            return
        record.state = "running"
        record.started.set()

    def _platform_env(self, record: SandboxRecord, task_id: str) -> dict[str, str]:
        """What Modal itself sets in a sandbox (not recorded: the caller did not ask)."""
        return {
            "MODAL_IS_REMOTE": "1",
            "MODAL_SANDBOX_ID": record.sandbox_id,
            "MODAL_TASK_ID": task_id,
            "MODAL_IMAGE_ID": record.image_id,
            "MODAL_ENVIRONMENT": record.environment,
        }

    async def end(
        self,
        record: SandboxRecord,
        status: api_pb2.GenericResult.GenericStatus.ValueType,
        *,
        exitcode: int = 0,
        exception: str = "",
    ) -> api_pb2.GenericResult:
        """End it (once: a later end keeps the first result, which it returns)."""
        if record.result is not None:
            return record.result
        record.result = api_pb2.GenericResult(status=status, exitcode=exitcode, exception=exception)
        record.state = "ended"
        record.ended_at = self.state.now()
        record.ended.set()
        for tunnel in record.tunnels:
            await tunnel.close()
        if record.container_id is not None:
            await asyncio.to_thread(self.containers.remove, record.container_id)
        return record.result

    # --- what ends sandboxes -----------------------------------------------------------

    def _exit_heard(self, sandbox_id: str, exit_code: int) -> None:
        """From the Docker events thread: a container's process ended."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._exited, sandbox_id, exit_code)

    def _exited(self, sandbox_id: str, exit_code: int) -> None:
        record = self.state.sandboxes.get(sandbox_id)
        if record is None or record.result is not None:
            return  # not ours any more, or we ended it (terminate, timeout)
        status = (
            GenericStatus.GENERIC_STATUS_SUCCESS
            if exit_code == 0
            else GenericStatus.GENERIC_STATUS_FAILURE
        )
        self._spawn(self.end(record, status, exitcode=exit_code))

    async def check_deadlines(self) -> list[str]:
        """End every sandbox past its deadline on the emulator's clock; their ids."""
        now = self.state.now()
        due = [r for r in self.state.sandboxes.values() if r.result is None and r.deadline <= now]
        for record in due:
            await self.end(
                record,
                GenericStatus.GENERIC_STATUS_TIMEOUT,
                exception=f"Sandbox timed out after {record.timeout_secs} seconds",
            )
        return [r.sandbox_id for r in due]

    async def _watch_deadlines(self) -> None:
        while True:
            await asyncio.sleep(_DEADLINE_CHECK)
            await self.check_deadlines()

    async def advance_clock(self, seconds: float) -> list[str]:
        self.state.clock_offset += seconds
        return await self.check_deadlines()

    async def reset(self) -> None:
        """End and forget every sandbox; clear switches, faults and calls."""
        for record in list(self.state.sandboxes.values()):
            await self.end(record, GenericStatus.GENERIC_STATUS_TERMINATED)
        await asyncio.to_thread(self.containers.remove_all)
        self.state.sandboxes.clear()
        self.state.faults.clear()
        self.state.calls.clear()
        self.state.settings = type(self.state.settings)()
        self.state.clock_offset = 0.0
