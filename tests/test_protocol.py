"""Plain acquire and release calls are answered from uvicorn's HTTP parser
(api/protocol.py), ahead of the ASGI app. These tests serve a real uvicorn on a real
socket, with a real LeaseService (SQLite, static endpoints) behind the fast path. The
ASGI app behind the protocol only records what reaches it and echoes the body with
status 299, so a test can tell which calls the protocol answered itself.

The service as users run it (`serve`, over HTTP) is covered by the other test files,
which all go through this protocol."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import uvicorn
from opentelemetry.trace import NoOpTracer

from openalice_scheduler.api.fast import FastLeasePath
from openalice_scheduler.api.protocol import lease_protocol
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.policy import build_policy
from openalice_scheduler.providers.static import StaticProvider
from openalice_scheduler.service import LeaseService
from openalice_scheduler.store import LeaseStore
from tests.harness import SECRET, free_port

ROUTED = 299  # the status of every answer from the app behind the protocol


@dataclass
class Served:
    port: int
    service: LeaseService
    store: LeaseStore
    reached: list[tuple[str, str, bytes]] = field(default_factory=list)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    store = LeaseStore(f"sqlite:///{tmp_path}/state.db")
    await store.migrate()
    service = LeaseService(
        store, [StaticProvider("renderer=http://a:80,http://b:80")],
        build_policy("ordered-first-available"), Metrics(), NoOpTracer(),
    )
    result = Served(free_port(), service, store)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        result.reached.append((scope["method"], scope["path"], body))
        await send({"type": "http.response.start", "status": ROUTED,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    fast = FastLeasePath(app, secret=SECRET, limit=1 << 20, tracer=None,
                         state=SimpleNamespace(service=service))
    server = uvicorn.Server(uvicorn.Config(
        app, host="127.0.0.1", port=result.port, http=lease_protocol(fast), lifespan="off",
        log_config=None, access_log=False,
    ))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        assert not serving.done(), "uvicorn did not start"
        await asyncio.sleep(0.01)
    yield result
    server.should_exit = True
    await asyncio.wait_for(serving, 30)
    await store.close()


def acquire(body: dict[str, Any] | bytes | None = None, *, extra: str = "",
            version: str = "1.1") -> bytes:
    raw = body if isinstance(body, bytes) else json.dumps(body or {"kind": "renderer"}).encode()
    return (f"POST /v1/lease HTTP/{version}\r\nHost: t\r\nX-Internal-Secret: {SECRET}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n{extra}\r\n"
            ).encode() + raw


def release(lease_id: str, owner: str | None = None) -> bytes:
    extra = f"X-Lease-Owner: {owner}\r\n" if owner else ""
    return (f"DELETE /v1/lease/{lease_id} HTTP/1.1\r\nHost: t\r\n"
            f"X-Internal-Secret: {SECRET}\r\n{extra}\r\n").encode()


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: t\r\nX-Internal-Secret: {SECRET}\r\n\r\n".encode()


class Connection:
    """HTTP/1.1 by hand, so that requests can be pipelined and hang-ups chosen."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def send(self, *requests: bytes) -> None:
        self.writer.write(b"".join(requests))  # one write: pipelined
        await self.writer.drain()

    async def answer(self) -> tuple[int, dict[str, str], bytes]:
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 30)
        status_line, *lines = head.decode("latin-1").split("\r\n")[:-2]
        headers = dict(line.split(": ", 1) for line in lines)
        length = int(headers.get("content-length", "0"))
        body = await asyncio.wait_for(self.reader.readexactly(length), 30)
        return int(status_line.split(" ")[1]), headers, body

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def test_plain_calls_are_answered_without_the_app(served: Served) -> None:
    http = await Connection.open(served.port)
    await http.send(acquire({"kind": "renderer", "owner_id": "alice"}))
    status, headers, body = await http.answer()
    assert status == 200, body
    assert headers["content-type"] == "application/json"
    assert headers["server"] == "uvicorn" and "date" in headers  # as uvicorn answers
    lease = json.loads(body)["lease"]
    assert (lease["state"], lease["owner_id"], lease["endpoint"]) == (
        "active", "alice", "http://a:80")
    stored = await served.store.get(lease["lease_id"])
    assert stored is not None and stored.state == "active"

    # The release, on the same kept-alive connection: wrong owner first.
    await http.send(release(lease["lease_id"], owner="bob"))
    status, _, body = await http.answer()
    assert (status, json.loads(body)["error"]) == (403, "forbidden")
    await http.send(release(lease["lease_id"], owner="alice"))
    status, headers, body = await http.answer()
    assert (status, body) == (204, b"") and "content-length" not in headers
    stored = await served.store.get(lease["lease_id"])
    assert stored is not None and (stored.state, stored.release_reason) == (
        "released", "explicit")
    assert served.reached == []

    await http.send(get("/v1/leases"))
    assert (await http.answer())[0] == ROUTED
    assert served.reached == [("GET", "/v1/leases", b"")]
    await http.close()


async def test_calls_it_does_not_take_reach_the_app_whole(served: Served) -> None:
    http = await Connection.open(served.port)
    # A body that is not a LeaseRequest: the app gets the call with every byte of it.
    invalid = json.dumps({"kind": "painter", "ttl_seconds": 60}).encode()
    await http.send(acquire(invalid))
    status, _, body = await http.answer()
    assert (status, body) == (ROUTED, invalid)
    assert served.reached == [("POST", "/v1/lease", invalid)]
    # A wrong secret, an Origin (CORS), a query string, a release with a body.
    await http.send(acquire().replace(SECRET.encode(), b"wrong"))
    await http.send(acquire(extra="Origin: http://example.test\r\n"))
    await http.send(acquire().replace(b"/v1/lease ", b"/v1/lease?x=1 "))
    with_body = b"\r\nContent-Length: 2\r\n\r\n{}"
    await http.send(release(str(uuid.uuid4())).replace(b"\r\n\r\n", with_body))
    for _ in range(4):
        assert (await http.answer())[0] == ROUTED
    assert [(m, p) for m, p, _ in served.reached[1:]] == [
        ("POST", "/v1/lease"), ("POST", "/v1/lease"), ("POST", "/v1/lease"),
        ("DELETE", served.reached[-1][1])]
    await http.close()
    # A caller waiting for `100 Continue` gets it from uvicorn, and then the app's answer.
    http = await Connection.open(served.port)
    await http.send(acquire(extra="Expect: 100-continue\r\n"))
    assert [(await http.answer())[0] for _ in range(2)] == [100, ROUTED]
    await http.close()
    # HTTP/1.0 is uvicorn's to answer.
    http = await Connection.open(served.port)
    await http.send(acquire(version="1.0"))
    assert (await http.answer())[0] == ROUTED
    await http.close()
    assert len(served.reached) == 7
    assert await served.store.live() == []


async def test_pipelined_calls_are_answered_in_order(served: Served) -> None:
    """A call that arrives while one is being answered on the same connection waits
    for it. Behind a call answered here, uvicorn queues it for the app: in the service
    that is the same fast path in ASGI (api/fast.py), which answers alike."""
    http = await Connection.open(served.port)
    unknown = str(uuid.uuid4())
    await http.send(acquire(), get("/between"), release(unknown), acquire())
    answers = [await http.answer() for _ in range(4)]
    assert [a[0] for a in answers] == [200, ROUTED, ROUTED, ROUTED], answers
    assert [(m, p) for m, p, _ in served.reached] == [
        ("GET", "/between"), ("DELETE", f"/v1/lease/{unknown}"), ("POST", "/v1/lease")]
    # Once the line is idle again, the next call is answered here.
    await http.send(acquire())
    status, _, body = await http.answer()
    assert status == 200 and len(served.reached) == 3
    endpoints = {json.loads(a)["lease"]["endpoint"] for a in (answers[0][2], body)}
    assert endpoints == {"http://a:80", "http://b:80"}
    await http.close()


async def test_connection_close_is_honoured(served: Served) -> None:
    http = await Connection.open(served.port)
    await http.send(acquire(extra="Connection: close\r\n"))
    status, headers, _ = await http.answer()
    assert status == 200 and headers["connection"] == "close"
    assert await asyncio.wait_for(http.reader.read(), 10) == b""  # the server hung up
    await http.close()


async def test_a_caller_that_hangs_up_while_waiting_gets_no_lease(served: Served) -> None:
    http = await Connection.open(served.port)
    held = []
    for _ in range(2):
        await http.send(acquire())
        held.append(json.loads((await http.answer())[2])["lease"]["lease_id"])

    waiting = await Connection.open(served.port)
    await waiting.send(acquire({"kind": "renderer", "wait_seconds": 120}))
    for _ in range(500):
        if len(served.service.queue):
            break
        await asyncio.sleep(0.01)
    assert len(served.service.queue) == 1, "the acquire should wait for capacity"
    await waiting.close()
    # It leaves the queue when the caller hangs up, not after its 120 s.
    for _ in range(500):
        if not len(served.service.queue):
            break
        await asyncio.sleep(0.01)
    assert len(served.service.queue) == 0, "the gone caller still waits"

    await http.send(release(held[0]))
    assert (await http.answer())[0] == 204
    await asyncio.sleep(0.2)
    assert [lease.lease_id for lease in await served.store.live()] == [held[1]]
    await http.close()
