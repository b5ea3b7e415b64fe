"""uvicorn's HTTP protocol, answering the plain acquire and release calls itself.

Why: at 32 clients on static endpoints the service runs one event loop at 100 % of a
core, and uvicorn's ASGI cycle (a scope, a receive/send pair, two messages and two
writes per answer) is work it must spare: with the lease calls answered by a stub, a
round trip cost 0.223 ms of CPU that way and costs 0.178 ms here. The two
calls are taken from the parser (httptools) and answered with one write; everything
else, and every call the fast path does not take (see api/fast.py), goes through
uvicorn's own cycle to the app, unchanged.

The rules are FastLeasePath's: this module only moves where they are applied. A call
taken here is answered with the bytes uvicorn would write for the same answer from the
app (status line, uvicorn's `date` and `server` headers, then the app's).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from openalice_scheduler.api.fast import FastLeasePath

_POST = b"POST"
_DELETE = b"DELETE"
_LEASE = b"/v1/lease"
_LEASE_PREFIX = b"/v1/lease/"


class _NobodyWaits:
    """`message_event` of a call that does not watch for its caller hanging up."""

    def set(self) -> None:
        pass


_NOBODY_WAITS = _NobodyWaits()


class _Call:
    """A call answered here: what uvicorn's code asks of `protocol.cycle`, as long as
    it is the connection's current request (keep_alive, response_complete, and the
    disconnect notice: `connection_lost` sets `disconnected` and `message_event`)."""

    __slots__ = ("kind", "lease_id", "headers", "body", "keep_alive", "response_complete",
                 "disconnected", "message_event")

    def __init__(self, kind: str, lease_id: str, headers: dict[bytes, bytes],
                 keep_alive: bool) -> None:
        self.kind = kind
        self.lease_id = lease_id
        self.headers = headers
        self.body: list[bytes] = []
        self.keep_alive = keep_alive
        self.response_complete = False
        self.disconnected = False
        # Set when the caller hangs up: an acquire may wait or provision for a while.
        self.message_event = asyncio.Event() if kind == "acquire" else _NOBODY_WAITS


class LeaseHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with plain acquire and release calls answered in place. Made
    for one app by `lease_protocol`."""

    fast: FastLeasePath

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lease_call: _Call | None = None  # the call being read, when it is one of ours
        self._cycle_before: Any = None  # uvicorn's cycle before it

    def on_headers_complete(self) -> None:
        self._lease_call = None
        cycle = self.cycle
        if cycle is None or cycle.response_complete:  # nothing in flight on this line
            call = self._take()
            if call is not None:
                self._lease_call = call
                self._cycle_before = cycle
                self.cycle = call  # type: ignore[assignment]
                return
        super().on_headers_complete()

    def _take(self) -> _Call | None:
        parser = self.parser
        method = parser.get_method()
        url = self.url
        if method == _POST:
            if url != _LEASE:
                return None
            kind, lease_id = "acquire", ""
        elif method == _DELETE:
            if not url.startswith(_LEASE_PREFIX):
                return None
            raw = url[len(_LEASE_PREFIX):]
            if not raw or b"/" in raw or b"?" in raw or b"%" in raw or b"#" in raw:
                return None
            kind, lease_id = "release", raw.decode("ascii", "replace")
        else:
            return None
        if (parser.get_http_version() != "1.1" or parser.should_upgrade()
                or self.expect_100_continue):  # uvicorn answers `100 Continue` itself
            return None
        headers = dict(self.headers)
        fast = self.fast
        if not (fast.takes_acquire(headers) if kind == "acquire" else fast.takes_release(headers)):
            return None
        return _Call(kind, lease_id, headers, parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        call = self._lease_call
        if call is None:
            super().on_body(body)
        else:
            call.body.append(body)

    def on_message_complete(self) -> None:
        call = self._lease_call
        if call is None:
            super().on_message_complete()
            return
        self._lease_call = None
        body = b"".join(call.body)
        if call.kind == "acquire":
            request = self.fast.parse_acquire(body)
            if request is None:
                self._hand_on(body)
                return
            assert isinstance(call.message_event, asyncio.Event)
            job = self.fast.acquire(request, call.message_event)
        else:
            job = self.fast.release(call.lease_id, call.headers)
        task = self.loop.create_task(self._answer(call, job))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def _hand_on(self, body: bytes) -> None:
        """A call that looked like ours but is not (an invalid body): to the app, as
        uvicorn would have handed it on, with the body already read."""
        self.cycle = self._cycle_before
        super().on_headers_complete()  # a new cycle, started at once: the line was idle
        self.cycle.body += body
        self.cycle.more_body = False
        self.cycle.message_event.set()

    async def _answer(self, call: _Call, job: Any) -> None:
        status, headers, body = await job
        if call.disconnected or self.transport.is_closing():
            return  # the caller hung up
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += (name, b": ", value, b"\r\n")
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        if not call.keep_alive:
            head.append(b"connection: close\r\n")
        head += (b"\r\n", body)
        self.transport.write(b"".join(head))
        call.response_complete = True
        if not call.keep_alive:
            self.transport.close()
        self.on_response_complete()


def lease_protocol(fast: FastLeasePath) -> type[LeaseHttpProtocol]:
    """The protocol class for uvicorn's `http=`, bound to the app's fast path."""
    return type("LeaseHttpProtocol", (LeaseHttpProtocol,), {"fast": fast})
