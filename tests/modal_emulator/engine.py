"""A sandbox's life: queued, scheduled, its container started with its tunnels, then
ended once.

- Queued while it cannot be placed (`settings.max_sandboxes` sandboxes are placed
  already): it has no task and no container, and is placed, oldest first, as places
  free (a placed sandbox ends, or the limit is raised). Modal queues a sandbox it cannot
  place yet instead of refusing it: its create is asynchronous ("The Sandbox's
  corresponding container will be created asynchronously",
  https://modal.com/docs/reference/modal.Sandbox, `create`), and the client waits for
  capacity (modal 1.6.4, `sandbox/_impl_v1.py`: `_SANDBOX_SCHEDULING_TIMEOUT`, "How long
  `Sandbox.create` waits for capacity before giving up", 21 minutes).
- Scheduling takes `settings.schedule_delay` seconds (real time); then the container is
  started on the emulator's network and each exposed port gets its tunnel.
- It ends exactly once, by the first of: its process exiting (SUCCESS with exit code 0,
  else FAILURE with the code), the kernel OOM-killing it at its memory limit
  (KERNEL_OOM_KILL, exit code 137), `terminate` (TERMINATED: return code 137), its
  deadline `started_at + timeout` on the emulator's clock (TIMEOUT: return code 124), a
  start that failed (FAILURE, with Docker's reason). Its tunnels close and its container
  is removed: an ended sandbox is gone, only its record stays.
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
_SIGKILL_EXIT = 128 + 9  # a process killed by SIGKILL, as the kernel OOM killer sends
_KILL_HEARD = 10.0  # seconds to hear the end of a container that ended by itself


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
        self._queue: list[SandboxRecord] = []  # not placed yet, oldest first

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
        """Take a new sandbox in: placed at once if there is room, else queued."""
        self.state.sandboxes[record.sandbox_id] = record
        self._queue.append(record)
        self.dispatch()

    def dispatch(self) -> None:
        """Place queued sandboxes, oldest first, while there is room (`max_sandboxes`).
        A queued sandbox that ended (terminated) leaves the queue without starting."""
        self._queue = [r for r in self._queue if r.state != "ended"]
        while self._queue and self.state.has_room():
            record = self._queue.pop(0)
            record.placed = True
            record.scheduling = self._spawn(self._schedule(record))

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
        # It ran, if only for a moment: a process that exits at once is ended by `_exited`,
        # which waits for this to finish first.
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
        record.started_at = self.state.now()
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
        """End it (once: a later end keeps the first result, which it returns once the
        first end has closed its tunnels and removed its container)."""
        if record.result is not None:
            await record.gone.wait()
            return record.result
        record.result = api_pb2.GenericResult(status=status, exitcode=exitcode, exception=exception)
        record.state = "ended"
        record.ended_at = self.state.now()
        record.ended.set()
        try:
            for tunnel in record.tunnels:
                await tunnel.close()
            if record.container_id is not None:
                await asyncio.to_thread(self.containers.remove, record.container_id)
        finally:
            record.gone.set()
            self.dispatch()  # its place (if it had one) goes to the oldest queued sandbox
        return record.result

    async def oom_kill(self, record: SandboxRecord) -> api_pb2.GenericResult:
        """Kill its container as the kernel's OOM killer does at the container's memory
        limit: SIGKILL (`docker kill`), then the result Modal records,
        GENERIC_STATUS_KERNEL_OOM_KILL ("Used when the kernel OOM-killed a process in the
        task's container after it hit its own memory limit", modal_proto/api_pb2.pyi)
        with the killed process's exit code, 137 (128 + SIGKILL). Only a running sandbox
        with a memory limit (`memory=(request, limit)`) can be: Modal's hard memory limit
        is what OOM-kills a container ("Modal containers can have a hard memory limit
        which will 'Out of Memory' (OOM) kill containers which attempt to exceed the
        limit", https://modal.com/docs/guide/resources, Memory limits); without one a
        container is not OOM-killed at a limit of its own. Raises ValueError otherwise."""
        if record.state != "running" or record.container_id is None:
            raise ValueError(f"sandbox {record.sandbox_id} is {record.state}, not running")
        if not record.memory_max_mb:
            raise ValueError(
                f"sandbox {record.sandbox_id} has no memory limit (memory=(request, limit)): "
                "Modal OOM-kills a container at its own hard memory limit only"
            )
        record.oom_kill_asked = True
        killed = await asyncio.to_thread(self.containers.kill, record.container_id)
        if not killed:  # its process had ended already: that end is its result
            record.oom_kill_asked = False
            await self.wait_ended(record, _KILL_HEARD)
            if record.result is None:
                raise ValueError(f"sandbox {record.sandbox_id}: its container is not running")
            return record.result
        return await self.end(
            record,
            GenericStatus.GENERIC_STATUS_KERNEL_OOM_KILL,
            exitcode=_SIGKILL_EXIT,
            exception=oom_exception(record.memory_max_mb),
        )

    # --- what ends sandboxes -----------------------------------------------------------

    def _exit_heard(self, sandbox_id: str, exit_code: int, oom_killed: bool) -> None:
        """From the Docker events thread: a container's process ended."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(
                lambda: self._spawn(self._exited(sandbox_id, exit_code, oom_killed))
            )

    async def _exited(self, sandbox_id: str, exit_code: int, oom_killed: bool) -> None:
        """Its process ended by itself: SUCCESS for exit code 0, else FAILURE with the code
        (the client's `returncode` is then that code, `_result_returncode` in modal
        1.6.4's `sandbox/_common.py`); KERNEL_OOM_KILL when Docker says the kernel
        OOM-killed it at its memory limit (its `oom` event or `State.OOMKilled`), or
        `oom_kill` killed it."""
        record = self.state.sandboxes.get(sandbox_id)
        if record is not None and record.container_id is None and record.scheduling is not None:
            # A process that exits at once ends before `containers.run` has returned: the
            # sandbox ran all the same, so its start is made whole (container, task id,
            # tunnels) before its end (as the Kubernetes emulator's kubelet does).
            await asyncio.gather(record.scheduling, return_exceptions=True)
        if record is None or record.result is not None:
            return  # not ours any more, or we ended it (terminate, timeout)
        if oom_killed or (record.oom_kill_asked and exit_code == _SIGKILL_EXIT):
            await self.end(
                record,
                GenericStatus.GENERIC_STATUS_KERNEL_OOM_KILL,
                exitcode=exit_code,
                exception=oom_exception(record.memory_max_mb),
            )
        elif exit_code == 0:
            await self.end(record, GenericStatus.GENERIC_STATUS_SUCCESS)
        else:
            await self.end(record, GenericStatus.GENERIC_STATUS_FAILURE, exitcode=exit_code)

    async def check_deadlines(self) -> list[str]:
        """End every sandbox past its deadline on the emulator's clock; their ids."""
        now = self.state.now()
        due = [
            r
            for r in self.state.sandboxes.values()
            if r.result is None and r.deadline is not None and r.deadline <= now
        ]
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
        """Move the clock and end, before answering, the sandboxes it took past their
        deadline (nothing else can end one meanwhile: this runs on the event loop)."""
        self.state.clock_offset += seconds
        return await self.check_deadlines()

    async def reset(self) -> None:
        """End and forget every sandbox; clear switches, faults, calls and the clock."""
        queued, self._queue = self._queue, []  # ended below, never started
        for record in queued + list(self.state.sandboxes.values()):
            await self.end(record, GenericStatus.GENERIC_STATUS_TERMINATED)
        await asyncio.to_thread(self.containers.remove_all)
        self.state.sandboxes.clear()
        self.state.faults.clear()
        self.state.calls.clear()
        self.state.settings = type(self.state.settings)()
        self.state.clock_offset = 0.0
        self.state.clock_frozen_at = None


def oom_exception(memory_limit_mb: int | None) -> str:
    """The result's `exception` of an OOM-killed sandbox (the emulator's wording)."""
    limit = f" of {memory_limit_mb} MiB" if memory_limit_mb else ""
    return f"Sandbox was OOM-killed by the kernel: it exceeded its memory limit{limit}."
