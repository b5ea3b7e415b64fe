"""The two calls that carry the load, `POST /v1/lease` and `DELETE /v1/lease/{id}`,
answered in plain ASGI ahead of FastAPI's routing.

Why: on the 2-core test host FastAPI's middleware, routing and dependency solving took
~0.5 ms of CPU per request, more than a lease on static endpoints costs itself (one
durable write), and the service runs on one core: answering these two calls here took
static round trips from 424 to ~770 a second at 32 clients (bench/throughput.py).

What it takes: only a plain, well-formed call, with the right `X-Internal-Secret`, a
JSON body with a Content-Length up to the body limit that validates as a
`LeaseRequest`, and no `Origin` header (CORS stays with its middleware). Everything
else goes on, unchanged, to the routes in leases.py, which remain the definition (and
the OpenAPI document): so a wrong secret, an invalid or oversized body, every other
route keep the one rendering they have there. The service's own errors are answered
here with the same body and headers as the app's handler for them (SchedulerError.body).

Under `serve`, uvicorn's protocol applies these same rules before any ASGI is involved
(api/protocol.py: `takes_acquire`, `parse_acquire`, `acquire`...). This middleware
answers what reaches the app anyway: a call pipelined behind another on its connection,
and every call when the app runs under another server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Tracer
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openalice_scheduler.errors import SchedulerError
from openalice_scheduler.models import LeaseRequest

log = logging.getLogger(__name__)

_LEASE = "/v1/lease"
_LEASE_PREFIX = "/v1/lease/"
_JSON = (b"content-type", b"application/json")
# What starlette's JSONResponse renders with, so both paths answer the same bytes.
_ENCODE = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
).encode
# An acquire still running after this long starts watching for the caller hanging up.
WATCH_AFTER_S = 0.05
# An answer: status, headers (lower-case names), body.
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
_INTERNAL = {"error": "internal_error", "message": "internal error; see the scheduler's log"}


class FastLeasePath:
    """ASGI middleware: serves the plain acquire and release calls itself (see module
    docstring) and hands every other request to `app`."""

    def __init__(self, app: ASGIApp, *, secret: str, limit: int, tracer: Tracer | None,
                 state: Any) -> None:
        self.app = app
        self.secret = secret.encode()
        self.limit = limit
        self.tracer = tracer  # None: no spans (tracing off)
        self.state = state  # app.state: the service appears there once the app started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        if method == "POST" and path == _LEASE:
            await self._acquire(scope, receive, send)
        elif (method == "DELETE" and path.startswith(_LEASE_PREFIX)
              and "/" not in path[len(_LEASE_PREFIX):] and len(path) > len(_LEASE_PREFIX)):
            await self._release(scope, receive, send, path[len(_LEASE_PREFIX):])
        else:
            await self.app(scope, receive, send)

    def _takes(self, headers: dict[bytes, bytes]) -> bool:
        return (
            b"origin" not in headers
            and hmac.compare_digest(headers.get(b"x-internal-secret", b""), self.secret)
            and getattr(self.state, "service", None) is not None
        )

    def takes_acquire(self, headers: dict[bytes, bytes]) -> bool:
        """Whether an acquire with these headers is ours, its body still unread."""
        length = headers.get(b"content-length", b"")
        content_type = headers.get(b"content-type", b"").split(b";", 1)[0].strip()
        return (self._takes(headers) and content_type == b"application/json"
                and length.isdigit() and int(length) <= self.limit)

    def takes_release(self, headers: dict[bytes, bytes]) -> bool:
        return self._takes(headers) and headers.get(b"content-length", b"0") == b"0"

    @staticmethod
    def parse_acquire(body: bytes) -> LeaseRequest | None:
        """The LeaseRequest in `body`; None when it is not one (the route says why)."""
        try:
            return LeaseRequest.model_validate_json(body)
        except ValidationError:
            return None

    async def acquire(self, request: LeaseRequest, gone: asyncio.Event) -> Answer:
        """The answer to an acquire taken here; `gone` is set if the caller hangs up."""
        service = self.state.service
        if self.tracer is None:  # the common case, without the layers a span needs
            try:
                record = await service.acquire(request, gone=gone)
            except Exception as exc:  # noqa: BLE001 - answered as the app's handler would
                return render(*_failure(exc))
            return render(*_granted(record))

        async def acquire() -> tuple[int, Any, Any]:
            return _granted(await service.acquire(request, gone=gone))

        return await self._answer("POST /v1/lease", "POST", acquire)

    async def release(self, lease_id: str, headers: dict[bytes, bytes]) -> Answer:
        owner_raw = headers.get(b"x-lease-owner")
        owner = None if owner_raw is None else owner_raw.decode("latin-1")
        service = self.state.service
        if self.tracer is None:
            try:
                await service.release(lease_id, owner)
            except Exception as exc:  # noqa: BLE001 - answered as the app's handler would
                return render(*_failure(exc))
            return render(204, None)

        async def release() -> tuple[int, Any, Any]:
            await service.release(lease_id, owner)
            return 204, None, None

        return await self._answer("DELETE /v1/lease/{lease_id}", "DELETE", release)

    async def _acquire(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.takes_acquire(dict(scope["headers"])):
            await self.app(scope, receive, send)
            return
        body, complete = await _read_body(receive, self.limit)
        request = self.parse_acquire(body) if complete else None
        if request is None:
            # Not ours to judge: the route renders the error, from the same bytes.
            await self.app(scope, _replay(body, complete, receive), send)
            return
        # Whether the caller hangs up matters to an acquire that waits or provisions:
        # watched from WATCH_AFTER_S on, so that a quick one spares the task.
        gone = asyncio.Event()
        watcher: list[asyncio.Task[None]] = []
        loop = asyncio.get_running_loop()
        timer = loop.call_later(WATCH_AFTER_S, lambda: watcher.append(
            loop.create_task(watch_disconnect(receive, gone))))
        try:
            answer = await self.acquire(request, gone)
        finally:
            timer.cancel()
            for task in watcher:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await _send(send, answer)

    async def _release(self, scope: Scope, receive: Receive, send: Send, lease_id: str) -> None:
        headers = dict(scope["headers"])
        if not self.takes_release(headers):
            await self.app(scope, receive, send)
            return
        await _send(send, await self.release(lease_id, headers))

    async def _answer(self, route: str, method: str,
                      call: Callable[[], Awaitable[tuple[int, Any, Any]]]) -> Answer:
        if self.tracer is None:
            return render(*await _call(call))
        with self.tracer.start_as_current_span(
            route, kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": route.split(" ", 1)[1]},
        ) as span:
            status, payload, extra = await _call(call)
            span.set_attribute("http.response.status_code", status)
            return render(status, payload, extra)


async def _call(call: Callable[[], Awaitable[tuple[int, Any, Any]]]) -> tuple[int, Any, Any]:
    try:
        return await call()
    except Exception as exc:  # noqa: BLE001 - answered as the app's handler would
        return _failure(exc)


def _granted(record: Any) -> tuple[int, Any, Any]:
    """(status, payload, headers) of an acquire that got `record`."""
    return 200, {"lease": record.wire(), "provider": record.provider}, None


def _failure(exc: Exception) -> tuple[int, Any, Any]:
    """(status, payload, headers) of the app's answer to `exc`."""
    if isinstance(exc, SchedulerError):
        return exc.status, exc.body(), exc.headers
    log.error("unexpected error: %s", type(exc).__name__, exc_info=exc)
    return 500, _INTERNAL, None


def render(status: int, payload: Any, extra: dict[str, str] | None = None) -> Answer:
    """(status, headers, body) as starlette's JSONResponse renders them (no body:
    `payload` None)."""
    body = b"" if payload is None else _ENCODE(payload).encode()
    headers = [] if payload is None else [(b"content-length", str(len(body)).encode()), _JSON]
    if extra:
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
    return status, headers, body


async def send_json(send: Send, status: int, payload: Any,
                    extra: dict[str, str] | None = None) -> None:
    """An answer rendered as starlette's JSONResponse renders it (no body: `payload` None)."""
    await _send(send, render(status, payload, extra))


async def _send(send: Send, answer: Answer) -> None:
    status, headers, body = answer
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The request body, and whether it ended within `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunk = message.get("body", b"")
        size += len(chunk)
        chunks.append(chunk)
        if size > limit:
            return b"".join(chunks), False
        if not message.get("more_body", False):
            return b"".join(chunks), True


def _replay(body: bytes, complete: bool, receive: Receive) -> Receive:
    """`receive` for the next app, starting with the body already read."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": not complete}
        return await receive()

    return replay


async def watch_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    """Set `gone` when the client hangs up. Called once the body is read, so the next
    message is the client going away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            return

