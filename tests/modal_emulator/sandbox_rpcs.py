"""The sandbox RPCs, both generations the client uses (modal 1.6.4, sandbox/_impl_v*.py):

- V1, for a sandbox with `gpu=` (or `MODAL_SANDBOX_V2=0`): `SecretGetOrCreate` for its
  `env`, `SandboxCreate` (answers at once), then `SandboxGetTaskId` polled every 0.5 s
  until the sandbox is scheduled (no task id while it is queued); `SandboxWait`,
  `SandboxGetTunnels`, `SandboxTerminate`, `SandboxTagsGet`/`Set`, `SandboxGetFromName`,
  `SandboxList`. `Sandbox.from_id` of a V1 id is a `SandboxWait` with timeout 0.
- V2, without a GPU: `SandboxCreateV2` (secrets and `env` inline; answers once the
  sandbox runs, with its task id and the tunnels of its encrypted ports, or at once
  without either while it is queued), then the `…V2` twins of the calls above.
  `Sandbox.list` is always `SandboxListV2` (both kinds), paged by `before_timestamp`
  until an empty page, of the sandboxes not finished (`include_finished=False`).

Which generation a sandbox id belongs to is in its shape (`state.new_sandbox_id`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from google.protobuf.empty_pb2 import Empty
from grpclib import GRPCError, Status
from modal_proto import api_pb2

from .objects import Stream, environment_name, received
from .state import GenericStatus, PortRequest, SandboxRecord, new_sandbox_id

if TYPE_CHECKING:
    from .engine import SandboxEngine
    from .state import EmulatorState

_H2 = api_pb2.TUNNEL_TYPE_H2
_LONGEST_WAIT = 55.0  # a long poll never holds a call longer than this


class _AboutSandbox(Protocol):
    """A request about one sandbox (`SandboxWaitRequest`, `SandboxTerminateRequest`, ...)."""

    sandbox_id: str


AboutSandboxT = TypeVar("AboutSandboxT", bound=_AboutSandbox)


def _tags(tags: Iterable[api_pb2.SandboxTag]) -> dict[str, str]:
    return {tag.tag_name: tag.tag_value for tag in tags}


def _tag_protos(tags: dict[str, str]) -> list[api_pb2.SandboxTag]:
    return [api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in tags.items()]


class SandboxRpcs:
    state: EmulatorState
    engine: SandboxEngine

    def _note_sandbox(self, sandbox_id: str) -> None:
        """Name the sandbox in the call log (the guard made the entry)."""
        raise NotImplementedError

    # --- creating ----------------------------------------------------------------------

    def _secret_env(self, secret_ids: Iterable[str]) -> dict[str, str]:
        env: dict[str, str] = {}
        for secret_id in secret_ids:
            if secret_id not in self.state.secrets:
                raise GRPCError(Status.NOT_FOUND, f"Secret {secret_id} not found")
            env.update(self.state.secrets[secret_id])
        return env

    def _new_record(
        self,
        api: str,
        app_id: str,
        definition: api_pb2.Sandbox,
        tags: dict[str, str],
        env: dict[str, str],
    ) -> SandboxRecord:
        app = next((a for a in self.state.apps.values() if a.app_id == app_id), None)
        if app is None:
            raise GRPCError(Status.NOT_FOUND, f"App {app_id} not found")
        image = self.state.images.get(definition.image_id)
        if image is None:
            raise GRPCError(Status.NOT_FOUND, f"Image {definition.image_id} not found")
        if image.error is not None:
            raise GRPCError(Status.FAILED_PRECONDITION, image.error)
        name = definition.name or None
        if name and any(
            s.name == name and s.app_id == app_id and s.state != "ended"
            for s in self.state.sandboxes.values()
        ):
            raise GRPCError(Status.ALREADY_EXISTS, f"Sandbox with name '{name}' already exists")
        resources = definition.resources
        gpu = resources.gpu_config.gpu_type or None
        refusal = self.state.capacity_refusal(gpu)
        if refusal is not None:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, refusal)
        env = {**env, **dict(definition.environment_variables.contents)}
        return SandboxRecord(
            sandbox_id=new_sandbox_id(api),
            api=api,
            app_id=app_id,
            environment=app.environment,
            created_at=self.state.creation_time(),
            image_id=image.image_id,
            image=image.reference,
            command=list(definition.entrypoint_args) or None,
            gpu=gpu,
            gpu_count=resources.gpu_config.count if gpu else 0,
            cpu=resources.milli_cpu / 1000 if resources.milli_cpu else None,
            cpu_max=resources.milli_cpu_max / 1000 if resources.milli_cpu_max else None,
            memory_mb=resources.memory_mb or None,
            memory_max_mb=resources.memory_mb_max or None,
            timeout_secs=definition.timeout_secs,
            idle_timeout_secs=definition.idle_timeout_secs or None,
            name=name,
            regions=list(definition.scheduler_placement.regions),
            workdir=definition.workdir or None,
            tags=tags,
            ports=[
                PortRequest(port=p.port, encrypted=not p.unencrypted, h2=p.tunnel_type == _H2)
                for p in definition.open_ports.ports
            ],
            env=env,
        )

    async def SandboxCreate(
        self, stream: Stream[api_pb2.SandboxCreateRequest, api_pb2.SandboxCreateResponse]
    ) -> None:
        request = await received(stream)
        env = self._secret_env(request.definition.secret_ids)
        record = self._new_record(
            "v1", request.app_id, request.definition, _tags(request.tags), env
        )
        self.engine.admit(record)
        self._note_sandbox(record.sandbox_id)
        await stream.send_message(
            api_pb2.SandboxCreateResponse(
                sandbox_id=record.sandbox_id, metadata=self._metadata(record)
            )
        )

    async def SandboxCreateV2(
        self, stream: Stream[api_pb2.SandboxCreateV2Request, api_pb2.SandboxCreateV2Response]
    ) -> None:
        request = await received(stream)
        env = self._secret_env(request.definition.secret_ids)
        env.update(request.ephemeral_secrets.contents)
        for source in request.secret_sources:
            if source.HasField("env"):
                env.update(source.env.contents)
            else:
                env.update(self._secret_env([source.secret_id]))
        record = self._new_record(
            "v2", request.app_id, request.definition, _tags(request.tags), env
        )
        self.engine.admit(record)
        self._note_sandbox(record.sandbox_id)
        # A sandbox placed at once is answered once it runs, with its task id and
        # tunnels; a queued one at once, with neither. The V2 client needs neither at
        # create and waits for nothing there (modal 1.6.4, `sandbox/_impl_v2.py`
        # `create`: it keeps `task_id=create_resp.task_id`, which may be empty, and
        # `get_task_id` polls `SandboxGetTaskIdV2` when a task id is needed; it keeps
        # the tunnels only when they are all there, else `tunnels()` asks
        # `SandboxGetTunnelsV2`, which waits). Unlike V1's create it has no wait for
        # capacity of its own, and no deadline on the call: held until a place frees,
        # this create would hang. Modal: "The Sandbox's corresponding container will be
        # created asynchronously" (https://modal.com/docs/reference/modal.Sandbox, `create`).
        if record.placed:
            await self.engine.wait_started(record, None)
        # Like Modal: the encrypted ports' tunnels now; unencrypted endpoints come from
        # SandboxGetTunnelsV2 (the client asks when this list is incomplete).
        tunnels = [t for t in self._tunnel_protos(record) if not t.unencrypted_host]
        if self.state.settings.hold_tunnels:
            tunnels = []  # not reported yet: the client asks SandboxGetTunnelsV2
        await stream.send_message(
            api_pb2.SandboxCreateV2Response(
                sandbox_id=record.sandbox_id,
                task_id=record.task_id,
                tunnels=tunnels,
                metadata=self._metadata(record),
            )
        )

    # --- one sandbox -------------------------------------------------------------------

    async def _requested(
        self, stream: Stream[AboutSandboxT, Any]
    ) -> tuple[AboutSandboxT, SandboxRecord]:
        """The request of a call about one sandbox, and that sandbox (NOT_FOUND if there
        is none)."""
        request = await received(stream)
        self._note_sandbox(request.sandbox_id)
        record = self.state.sandboxes.get(request.sandbox_id)
        if record is None:
            raise GRPCError(Status.NOT_FOUND, f"Sandbox {request.sandbox_id} not found")
        return request, record

    def _metadata(self, record: SandboxRecord) -> api_pb2.SandboxHandleMetadata:
        # A field given None is left unset (protobuf): no result while the sandbox runs.
        return api_pb2.SandboxHandleMetadata(app_id=record.app_id, result=record.result)

    def _tunnel_protos(self, record: SandboxRecord) -> list[api_pb2.TunnelData]:
        return [
            api_pb2.TunnelData(
                host=t.host,
                port=t.tls_port,
                unencrypted_host=t.host if t.tcp_port else "",
                unencrypted_port=t.tcp_port,
                container_port=t.container_port,
            )
            for t in record.tunnels
        ]

    async def _get_task_id(
        self, stream: Stream[api_pb2.SandboxGetTaskIdRequest, api_pb2.SandboxGetTaskIdResponse]
    ) -> None:
        request, record = await self._requested(stream)
        if request.timeout > 0:
            await self.engine.wait_started(record, min(request.timeout, _LONGEST_WAIT))
        # No task id while queued or scheduling: the client polls again 0.5 s later
        # (modal 1.6.4, `sandbox/_common.py` `task_id_from_response`); an ended sandbox
        # also answers its result, and one that never ran (terminated while queued) has
        # no task id, so a client still waiting for one gets ConflictError.
        await stream.send_message(
            api_pb2.SandboxGetTaskIdResponse(task_id=record.task_id, task_result=record.result)
        )

    SandboxGetTaskId = SandboxGetTaskIdV2 = _get_task_id

    async def _wait(
        self, stream: Stream[api_pb2.SandboxWaitRequest, api_pb2.SandboxWaitResponse]
    ) -> None:
        request, record = await self._requested(stream)
        await self.engine.wait_ended(record, min(request.timeout, _LONGEST_WAIT))
        await stream.send_message(
            api_pb2.SandboxWaitResponse(metadata=self._metadata(record), result=record.result)
        )

    SandboxWait = SandboxWaitV2 = _wait

    async def _get_tunnels(
        self, stream: Stream[api_pb2.SandboxGetTunnelsRequest, api_pb2.SandboxGetTunnelsResponse]
    ) -> None:
        request, record = await self._requested(stream)
        response = api_pb2.SandboxGetTunnelsResponse()
        wait = min(request.timeout, _LONGEST_WAIT)
        asked_at = time.monotonic()
        started = await self.engine.wait_started(record, wait)
        if started and self.state.settings.hold_tunnels:
            # Running, its tunnels not reported within the request's timeout: the
            # client's "SandboxTimeoutError: If the tunnels are not available after the
            # timeout" (https://modal.com/docs/reference/modal.Sandbox#tunnels).
            await self.engine.wait_ended(record, wait - (time.monotonic() - asked_at))
            if record.state != "ended":
                response.result.status = GenericStatus.GENERIC_STATUS_TIMEOUT
        elif started:
            response.tunnels.extend(self._tunnel_protos(record))
        elif record.state == "pending":
            # Not running within the request's timeout (queued, or still scheduling): a
            # result of TIMEOUT, which the client raises as SandboxTimeoutError (modal
            # 1.6.4, `sandbox/_common.py` `tunnels_from_response`).
            response.result.status = GenericStatus.GENERIC_STATUS_TIMEOUT
        await stream.send_message(response)

    SandboxGetTunnels = SandboxGetTunnelsV2 = _get_tunnels

    async def _terminate(
        self, stream: Stream[api_pb2.SandboxTerminateRequest, api_pb2.SandboxTerminateResponse]
    ) -> None:
        request, record = await self._requested(stream)
        existing = record.result
        await self.engine.end(record, GenericStatus.GENERIC_STATUS_TERMINATED)
        await stream.send_message(api_pb2.SandboxTerminateResponse(existing_result=existing))

    SandboxTerminate = SandboxTerminateV2 = _terminate

    async def _tags_set(self, stream: Stream[api_pb2.SandboxTagsSetRequest, Empty]) -> None:
        request, record = await self._requested(stream)
        record.tags = _tags(request.tags)
        await stream.send_message(Empty())

    SandboxTagsSet = SandboxTagsSetV2 = _tags_set

    async def _tags_get(
        self, stream: Stream[api_pb2.SandboxTagsGetRequest, api_pb2.SandboxTagsGetResponse]
    ) -> None:
        request, record = await self._requested(stream)
        await stream.send_message(api_pb2.SandboxTagsGetResponse(tags=_tag_protos(record.tags)))

    SandboxTagsGet = SandboxTagsGetV2 = _tags_get

    async def _get_from_name(
        self,
        stream: Stream[api_pb2.SandboxGetFromNameRequest, api_pb2.SandboxGetFromNameResponse],
    ) -> None:
        request = await received(stream)
        app = self.state.apps.get((environment_name(request.environment_name), request.app_name))
        named = [
            s
            for s in self.state.sandboxes.values()
            if app is not None and s.app_id == app.app_id and s.name == request.sandbox_name
        ]
        live = [s for s in named if s.state != "ended"]
        found = (live or (named if request.include_terminated else []))[-1:]
        if not found:
            raise GRPCError(Status.NOT_FOUND, f"Sandbox '{request.sandbox_name}' not found")
        self._note_sandbox(found[0].sandbox_id)
        await stream.send_message(
            api_pb2.SandboxGetFromNameResponse(
                sandbox_id=found[0].sandbox_id, metadata=self._metadata(found[0])
            )
        )

    SandboxGetFromName = SandboxGetFromNameV2 = _get_from_name

    # --- listing -----------------------------------------------------------------------

    async def _list(
        self, stream: Stream[api_pb2.SandboxListRequest, api_pb2.SandboxListResponse]
    ) -> None:
        request = await received(stream)
        # The client always asks `include_finished=False` (modal 1.6.4,
        # `sandbox/_sandbox.py` `_list`), for "Sandbox objects that are currently
        # running" (`_experimental_list`): not the ended ones, whatever ended them, but
        # the queued ones, which have not finished. `include_finished=True`, which no
        # client call sends, lists the ended ones too.
        wanted = _tags(request.tags)
        environment = environment_name(request.environment_name)
        matching = [
            s
            for s in self.state.sandboxes.values()
            if (s.app_id == request.app_id if request.app_id else s.environment == environment)
            and (request.include_finished or s.state != "ended")
            and all(s.tags.get(k) == v for k, v in wanted.items())
            and (not request.before_timestamp or s.created_at < request.before_timestamp)
        ]
        matching.sort(key=lambda s: s.created_at, reverse=True)
        page = matching[: self.state.settings.list_page_size]
        await stream.send_message(
            api_pb2.SandboxListResponse(sandboxes=[self._info(s) for s in page])
        )

    SandboxList = SandboxListV2 = _list

    def _info(self, record: SandboxRecord) -> api_pb2.SandboxInfo:
        task = api_pb2.TaskInfo(
            id=record.task_id,
            sandbox_id=record.sandbox_id,
            gpu_type=record.gpu or "",
            enqueued_at=record.created_at,
            result=record.result,
        )
        return api_pb2.SandboxInfo(
            id=record.sandbox_id,
            created_at=record.created_at,
            task_info=task,
            app_id=record.app_id,
            tags=_tag_protos(record.tags),
            name=record.name or "",
            image_id=record.image_id,
            timeout_secs=record.timeout_secs,
            regions=record.regions,
            metadata=self._metadata(record),
        )
