"""The request rules that hold before any route runs, as pure ASGI middleware, each
written once. `install` puts them in their order; every refusal is rendered by
errors.error_response, as the exception handlers render every other error."""

from __future__ import annotations

import asyncio
import hmac

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openalice_scheduler.api.errors import error_response
from openalice_scheduler.errors import (
    BodyTooLarge,
    DuplicateHeader,
    Forbidden,
    HeadersTooLarge,
    RequestTimeout,
    SchedulerError,
    Unauthorized,
)
from openalice_scheduler.lease_access import SELF_PATH, LeaseAccess

MAX_BODY_BYTES = 1024 * 1024
MAX_HEADER_BYTES = 16 * 1024
# A whole body must arrive within this; a caller that stalls is answered 408 and cut off.
BODY_TIMEOUT_S = 15.0
# Headers whose repetition would make two parts of the stack read different values (a
# proxy in front may check the first credential where SecretGate reads the last).
ONCE_ONLY = (
    b"x-internal-secret",
    b"authorization",
    b"x-lease-owner",
    b"content-type",
    b"content-length",
)


def install(app: FastAPI, *, secret: str, cors_origins: list[str], access: LeaseAccess) -> None:
    """The rules in the order they decide (the last added runs first): duplicate headers
    before anything else, header size, CORS (its preflights need no secret), the secret
    (nothing is read unauthenticated), then the body."""
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES, timeout=BODY_TIMEOUT_S)
    app.add_middleware(SecretGate, secret=secret, access=access)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cors_origins,
            allow_methods=["GET", "POST", "DELETE"],
            # A page's request id and trace context reach the access log (access.py) too,
            # and the page can read the id it was answered with.
            allow_headers=[
                "Content-Type",
                "X-Internal-Secret",
                "X-Lease-Owner",
                "X-Request-ID",
                "traceparent",
                "tracestate",
            ],
            expose_headers=["X-Request-ID"],
        )
    app.add_middleware(HeaderLimit, limit=MAX_HEADER_BYTES)
    app.add_middleware(DuplicateHeaders, names=ONCE_ONLY)


class DuplicateHeaders:
    """400 `duplicate_header` when one of `names` appears more than once, on any route."""

    def __init__(self, app: ASGIApp, names: tuple[bytes, ...]) -> None:
        self.app = app
        self.names = frozenset(names)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            seen: set[bytes] = set()
            for name, _ in scope["headers"]:
                if name in self.names:
                    if name in seen:
                        error = DuplicateHeader(
                            f"header {name.decode()} is repeated; send it once",
                            header=name.decode(),
                        )
                        await _refuse(error, scope, receive, send, close=True)
                        return
                    seen.add(name)
        await self.app(scope, receive, send)


class HeaderLimit:
    """431 when the request's headers add up to more than `limit` bytes. (The server caps
    what it buffers before the headers are complete: see server.py.)"""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(name) + len(value) + 4 for name, value in scope["headers"])
            if size > self.limit:
                error = HeadersTooLarge(
                    f"request headers are larger than {self.limit} bytes", limit=self.limit
                )
                await _refuse(error, scope, receive, send, close=True)
                return
        await self.app(scope, receive, send)


class SecretGate:
    """Gated routes (/v1/...) need X-Internal-Secret, compared in constant time. One
    path takes a lease's own token instead (`Authorization: Bearer`): a worker's GET of
    its lease's view, /v1/lease/{id}/self (lease_access.py); a token of another lease
    there is a 403. Neither message ever repeats what was sent."""

    def __init__(self, app: ASGIApp, secret: str, access: LeaseAccess) -> None:
        self.app = app
        self.secret = secret.encode()
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = dict(scope["headers"])
            given = headers.get(b"x-internal-secret", b"")
            if not hmac.compare_digest(given, self.secret):
                error = self._lease_token(scope, headers.get(b"authorization", b""))
                if error is not None:
                    await _refuse(error, scope, receive, send)
                    return
        await self.app(scope, receive, send)

    def _lease_token(self, scope: Scope, authorization: bytes) -> SchedulerError | None:
        """None when a valid lease token opens this request, else the refusal."""
        scheme, _, token = authorization.partition(b" ")
        own = SELF_PATH.fullmatch(scope["path"])
        if (
            own is None
            or scheme.lower() != b"bearer"
            or not token.strip()
            or scope["method"] not in ("GET", "HEAD")
        ):
            return Unauthorized(
                "missing or wrong X-Internal-Secret header (a lease token "
                "opens only GET /v1/lease/{id}/self)"
            )
        if not self.access.valid(own[1], token.strip()):
            return Forbidden(
                "this bearer token is not the token of this lease: a worker "
                "may ask only after its own lease"
            )
        return None


class BodyLimit:
    """Every request body, on every route and method, chunked or not: 413 once it passes
    `limit` bytes, 408 when it has not arrived within `timeout` seconds. The body is read
    here, before the route runs (a route that ignores its body, DELETE say, is covered
    too), holding at most `limit` bytes and one chunk, then handed on."""

    def __init__(self, app: ASGIApp, limit: int, timeout: float) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is None and b"transfer-encoding" not in headers or length == b"0":
            await self.app(scope, receive, send)  # no body
            return
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _refuse(self._too_large(), scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return  # the caller hung up before its body was in
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.limit:
                        await _refuse(self._too_large(), scope, receive, send)
                        return
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            error = RequestTimeout(f"request body not received within {self.timeout:g} s")
            await _refuse(error, scope, receive, send, close=True)
            return
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _too_large(self) -> BodyTooLarge:
        return BodyTooLarge(f"request body is larger than {self.limit} bytes", limit=self.limit)


async def _refuse(
    error: SchedulerError, scope: Scope, receive: Receive, send: Send, *, close: bool = False
) -> None:
    await error_response(error, close=close)(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for the app: the body read already, then the server's own messages."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
