"""The gRPC servicer: `modal_proto.api_grpc.ModalClientBase` with the emulated RPCs.

Every call, emulated or not, goes through one guard first, in this order:
1. the client's version must be the one the emulator was checked against (modal 1.6.4;
   FAILED_PRECONDITION otherwise: an upgrade of `modal` is a deliberate change);
2. its credentials (UNAUTHENTICATED, see auth.py);
3. a delay switched on for the RPC (`rpc_delay`);
4. a failure switched on for it (`fail_next`);
then the call is recorded (RPC, answer status, attempt, idempotency key, sandbox) and
answered. An RPC the emulator does not emulate answers UNIMPLEMENTED, recorded too.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpclib.const
import grpclib.server
from grpclib import GRPCError, Status
from modal_proto import api_grpc

from .auth import Credentials
from .engine import SandboxEngine
from .objects import ObjectRpcs
from .sandbox_rpcs import SandboxRpcs
from .state import Call, EmulatorState
from .version import CHECKED_CLIENT_VERSION

log = logging.getLogger("modal_emulator")
_MAX_CALLS = 20_000  # the call log keeps the latest ones
_current_call: contextvars.ContextVar[Call | None] = contextvars.ContextVar(
    "modal_emulator_call", default=None
)
Handler = Callable[[grpclib.server.Stream[Any, Any]], Awaitable[None]]


class ModalServicer(ObjectRpcs, SandboxRpcs, api_grpc.ModalClientBase):
    def __init__(
        self,
        state: EmulatorState,
        engine: SandboxEngine,
        credentials: Credentials,
        client_versions: frozenset[str] = frozenset({CHECKED_CLIENT_VERSION}),
    ) -> None:
        self.state = state
        self.engine = engine
        self.credentials = credentials
        self.client_versions = client_versions
        self._built: set[str] = set()

    def _note_sandbox(self, sandbox_id: str) -> None:
        call = _current_call.get()
        if call is not None:
            call.sandbox_id = sandbox_id

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            path: grpclib.const.Handler(
                self._guarded(path.rsplit("/", 1)[-1], handler.func),
                handler.cardinality,
                handler.request_type,
                handler.reply_type,
            )
            for path, handler in super().__mapping__().items()
        }

    def _check_client(self, metadata: Mapping[str, object]) -> None:
        version = metadata.get("x-modal-client-version")
        if version not in self.client_versions:
            raise GRPCError(
                Status.FAILED_PRECONDITION,
                f"modal client {version} is not the one this emulator was checked against "
                f"({', '.join(sorted(self.client_versions))}): check the emulator against the "
                "new client (tests/modal_emulator/README.md) before upgrading modal",
            )

    def _record(self, rpc: str, metadata: Mapping[str, object]) -> Call:
        key = metadata.get("x-idempotency-key")
        attempt = metadata.get("x-retry-attempt")
        call = Call(
            rpc=rpc,
            status="OK",
            at=time.time(),
            attempt=int(attempt) if isinstance(attempt, str) and attempt.isdigit() else 0,
            idempotency_key=key if isinstance(key, str) else None,
        )
        self.state.calls.append(call)
        if len(self.state.calls) > _MAX_CALLS:
            del self.state.calls[: len(self.state.calls) - _MAX_CALLS]
        return call

    def _guarded(self, rpc: str, handler: Handler) -> Handler:
        async def guarded(stream: grpclib.server.Stream[Any, Any]) -> None:
            metadata: Mapping[str, object] = stream.metadata or {}
            call = self._record(rpc, metadata)
            token = _current_call.set(call)
            try:
                self._check_client(metadata)
                self.credentials.check(rpc, metadata)
                delay = self.state.rpc_delay(rpc)
                if delay > 0:
                    await asyncio.sleep(delay)
                fault = self.state.take_fault(rpc, call.idempotency_key)
                if fault is not None:
                    raise GRPCError(fault.status, fault.message)
                await handler(stream)
            except GRPCError as exc:
                call.status = exc.status.name
                raise
            except Exception as exc:
                call.status = Status.INTERNAL.name
                log.exception("%s failed in the emulator", rpc)
                raise GRPCError(Status.INTERNAL, f"emulator error in {rpc}: {exc}") from exc
            finally:
                _current_call.reset(token)

        return guarded


def _not_emulated(name: str) -> Callable[[Any, Any], Awaitable[None]]:
    async def handler(self: Any, stream: Any) -> None:
        raise GRPCError(Status.UNIMPLEMENTED, f"{name} is not emulated")

    handler.__name__ = name
    return handler


ALL_RPCS = frozenset(api_grpc.ModalClientBase.__abstractmethods__)
EMULATED_RPCS = ALL_RPCS - ModalServicer.__abstractmethods__
for _name in ModalServicer.__abstractmethods__:
    setattr(ModalServicer, _name, _not_emulated(_name))
ModalServicer.__abstractmethods__ = frozenset()
