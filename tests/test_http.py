"""HTTP behaviour a caller sees on the wire, over raw sockets against the service as
users run it (`serve`): pipelining, keep-alive, hang-ups, limits, timeouts, the rules
every route shares."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable

import pytest

from tests.harness import HTTP, SECRET, Scheduler, wait_for

Make = Callable[..., Scheduler]
ONE = {"PROVIDERS": "static", "STATIC_WORKERS": "renderer=http://a:80"}
# uvicorn's two HTTP protocols (HTTP_PARSER).
PARSERS = ["h11", "httptools"]
TWO = {"PROVIDERS": "static", "STATIC_WORKERS": "renderer=http://a:80,http://b:80"}


class Wire:
    """HTTP/1.1 by hand on one socket: requests pipelined, hang-ups chosen."""

    def __init__(self, sched: Scheduler, timeout: float = 30) -> None:
        self.sock = socket.create_connection(("127.0.0.1", sched.port), timeout=timeout)
        self.buffer = b""

    def send(self, *requests: bytes) -> None:
        self.sock.sendall(b"".join(requests))  # one write: pipelined

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            self._read()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines)}
        length = int(headers.get("content-length", "0"))
        while len(self.buffer) < length:
            self._read()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split(" ")[1]), headers, body

    def closed_by_server(self, within: float) -> bool:
        """Whether the server closes the connection within `within` seconds."""
        self.sock.settimeout(within)
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return True
                self.buffer += chunk
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()

    def _read(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed by the server; unread: {self.buffer[:200]!r}")
        self.buffer += chunk


def request(
    method: str,
    path: str,
    body: bytes | None = None,
    *,
    extra: str = "",
    secret: bool = True,
    version: str = "1.1",
) -> bytes:
    head = f"{method} {path} HTTP/{version}\r\nHost: t\r\n"
    if secret:
        head += f"X-Internal-Secret: {SECRET}\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + extra + "\r\n").encode() + (body or b"")


def acquire(**fields: object) -> bytes:
    return request("POST", "/v1/lease", json.dumps({"kind": "renderer", **fields}).encode())


def waiting(sched: Scheduler) -> float:
    """Callers in line for a renderer (`scheduler_waiting_callers`)."""
    return sched.metric("scheduler_waiting_callers", kind="renderer", gpu="none")


def waits(sched: Scheduler, outcome: str) -> float:
    """Waits in line that ended so (`scheduler_wait_seconds{outcome}`'s count)."""
    return sched.metric("scheduler_wait_seconds_count", outcome=outcome)


# --- pipelining, keep-alive, hang-ups --------------------------------------------------


def test_pipelined_calls_are_answered_in_order_on_a_kept_alive_connection(
    make_scheduler: Make,
) -> None:
    sched = make_scheduler(**TWO)
    wire = Wire(sched)
    unknown = str(uuid.uuid4())
    wire.send(
        acquire(owner_id="alice"),
        request("GET", "/health", secret=False),
        request("DELETE", f"/v1/lease/{unknown}"),
        acquire(),
    )
    answers = [wire.answer() for _ in range(4)]
    assert [a[0] for a in answers] == [200, 200, 404, 200], answers
    assert json.loads(answers[2][2])["error"] == "lease_not_found"
    leases = [json.loads(answers[i][2])["lease"] for i in (0, 3)]
    assert {lease["endpoint"] for lease in leases} == {"http://a:80", "http://b:80"}
    # The release, on the same connection: wrong owner first.
    wire.send(
        request("DELETE", f"/v1/lease/{leases[0]['lease_id']}", extra="X-Lease-Owner: bob\r\n")
    )
    status, _, body = wire.answer()
    assert (status, json.loads(body)["error"]) == (403, "forbidden")
    wire.send(
        request("DELETE", f"/v1/lease/{leases[0]['lease_id']}", extra="X-Lease-Owner: alice\r\n")
    )
    status, headers, body = wire.answer()
    assert (status, body) == (204, b"")
    assert [lease["lease_id"] for lease in sched.leases()] == [leases[1]["lease_id"]]
    wire.close()


def test_connection_close_is_honoured(make_scheduler: Make) -> None:
    sched = make_scheduler(**ONE)
    wire = Wire(sched)
    wire.send(request("GET", "/v1/leases", extra="Connection: close\r\n"))
    status, headers, _ = wire.answer()
    assert status == 200 and headers["connection"] == "close"
    assert wire.closed_by_server(10)


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("behind", ["nothing", "a pipelined call"])
def test_a_caller_that_hangs_up_in_line_gets_no_worker(
    make_scheduler: Make, behind: str, parser: str
) -> None:
    """Regression: with a call pipelined behind it, the server stopped reading the
    connection and never told the waiting acquire that its caller had left. (uvicorn's
    h11 protocol now tells; its httptools one still does not: there only the watch of
    `api/hangup.py` notices.)"""
    sched = make_scheduler(**ONE, HTTP_PARSER=parser)
    held = sched.lease()
    wire = Wire(sched)
    pipelined = request("GET", "/v1/leases") if behind != "nothing" else b""
    wire.send(acquire(wait_seconds=60) + pipelined)
    wait_for(lambda: waiting(sched) == 1, 30, interval=0.1, what="the caller in line")
    wire.close()
    # The server notices (told by uvicorn, or, with a call pipelined behind, by its watch
    # asking the kernel): the caller leaves the line as gone, before any worker is free.
    wait_for(lambda: waits(sched, "gone") == 1, 30, interval=0.1, what="the hang-up noticed")
    assert waiting(sched) == 0
    assert sched.release(held["lease_id"]).status_code == 204
    assert sched.leases() == [], "the caller that hung up was given the freed worker"
    assert waits(sched, "served") == 0
    assert sched.acquire().status_code == 200  # and the endpoint is free for the next one


@pytest.mark.parametrize("parser", PARSERS)
def test_a_waiting_caller_that_stays_gets_the_freed_worker(
    make_scheduler: Make, parser: str
) -> None:
    """The other side of the hang-up watch: a caller with a call pipelined behind it
    that keeps its connection open is served, and then the call behind. The watch looks
    at it several times first: three callers behind it, each with a call pipelined too,
    hang up one after the other, and only a new look of the watch (the kernel asked for
    each watched connection's state) can notice each of them."""
    sched = make_scheduler(**ONE, HTTP_PARSER=parser)
    held = sched.lease()
    wire = Wire(sched)
    wire.send(acquire(wait_seconds=60) + request("GET", "/health", secret=False))
    wait_for(lambda: waiting(sched) == 1, 30, interval=0.1, what="the caller in line")
    behind = []
    for n in range(2, 5):
        leaver = Wire(sched)
        leaver.send(acquire(wait_seconds=60) + request("GET", "/health", secret=False))
        wait_for(lambda n=n: waiting(sched) == n, 30, interval=0.1, what=f"caller {n} in line")
        behind.append(leaver)
    for n, leaver in enumerate(behind, 1):
        leaver.close()
        wait_for(
            lambda n=n: waits(sched, "gone") == n, 30, interval=0.1, what=f"hang-up {n} noticed"
        )
        assert waiting(sched) == 4 - n  # the caller that stays is still in line
    assert sched.release(held["lease_id"]).status_code == 204
    status, _, body = wire.answer()
    assert status == 200, body
    assert wire.answer()[0] == 200
    served = json.loads(body)["lease"]["lease_id"]
    assert [lease["lease_id"] for lease in sched.leases()] == [served]
    wire.close()


def test_calls_of_every_shape_work(make_scheduler: Make) -> None:
    sched = make_scheduler(**ONE)
    # A chunked body.
    chunked = sched.http.post(
        "/v1/lease",
        content=iter([b'{"kind": ', b'"renderer"}']),
        headers={"Content-Type": "application/json"},
    )
    assert chunked.status_code == 200, chunked.text
    lease_id = chunked.json()["lease"]["lease_id"]
    # A DELETE with a small body is a release like any other.
    sent = sched.http.request("DELETE", f"/v1/lease/{lease_id}", content=b"{}")
    assert sent.status_code == 204, sent.text
    # A caller waiting for `100 Continue` gets it, then the answer; HTTP/1.0 is served.
    wire = Wire(sched)
    wire.send(acquire().replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n", 1))
    first, _, _ = wire.answer()
    second, _, body = wire.answer() if first == 100 else (first, {}, b"")
    assert (first, second) == (100, 200), body
    wire.close()
    wire = Wire(sched)
    wire.send(request("GET", "/v1/leases", version="1.0"))
    status, _, body = wire.answer()
    assert status == 200 and len(json.loads(body)) == 1
    wire.close()


# --- rules every route shares ----------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/leases", "/health"])
def test_a_repeated_header_is_refused_before_anything_else_decides(
    sched: Scheduler, path: str
) -> None:
    """Regression: a repeated header was read differently by different parts."""
    repeated = {
        "X-Internal-Secret": f"X-Internal-Secret: wrong\r\nX-Internal-Secret: {SECRET}\r\n",
        "X-Lease-Owner": "X-Lease-Owner: a\r\nX-Lease-Owner: b\r\n",
        "Content-Type": "Content-Type: application/json\r\nContent-Type: text/plain\r\n",
    }
    for name, extra in repeated.items():
        wire = Wire(sched)
        wire.send(request("GET", path, extra=extra, secret=name != "X-Internal-Secret"))
        status, headers, body = wire.answer()
        assert status == 400, (name, body)
        assert headers["content-type"] == "application/json"
        error = json.loads(body)
        assert (error["error"], error["header"]) == ("duplicate_header", name.lower())
        assert name.lower() in error["message"]
        wire.close()
    # Content-Length: the server itself refuses two values first (400, its plain text);
    # the same value twice it takes as one (RFC 9110, 8.6).
    wire = Wire(sched)
    wire.send(
        request("POST", path, b"{}").replace(
            b"Content-Length: 2\r\n", b"Content-Length: 2\r\nContent-Length: 3\r\n"
        )
    )
    assert wire.answer()[0] == 400
    wire.close()


def _rss_kib(sched: Scheduler) -> int:
    assert sched.proc is not None
    with open(f"/proc/{sched.proc.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _send_chunked(wire: Wire, head: bytes, total: int) -> threading.Thread:
    chunk = b"x" * 65536
    piece = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"

    def send() -> None:
        try:
            wire.sock.sendall(head)
            for _ in range(total // len(chunk)):
                wire.sock.sendall(piece)
            wire.sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server stopped reading: what the test wants

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


def test_every_body_is_cut_at_one_mib_without_being_held(make_scheduler: Make) -> None:
    """Regression: a chunked DELETE body was buffered whole (64 MiB)."""
    sched = make_scheduler(**ONE)
    lease = sched.lease()
    before = _rss_kib(sched)
    for method, path, secret in [
        ("DELETE", f"/v1/lease/{lease['lease_id']}", True),
        ("POST", "/v1/lease", True),
        ("GET", "/health", False),
    ]:
        wire = Wire(sched)
        head = request(
            method,
            path,
            secret=secret,
            extra="Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n",
        )
        sender = _send_chunked(wire, head, 64 << 20)
        status, _, body = wire.answer()
        assert (status, json.loads(body)["error"]) == (413, "body_too_large"), (method, body)
        wire.close()
        sender.join(30)
    assert _rss_kib(sched) - before < 32 * 1024, "the server held the bodies"
    # The DELETE was not carried out.
    assert [found["lease_id"] for found in sched.leases()] == [lease["lease_id"]]
    # A Content-Length over the limit is refused before any of it is read.
    wire = Wire(sched)
    wire.send(
        request("DELETE", f"/v1/lease/{lease['lease_id']}", extra=f"Content-Length: {64 << 20}\r\n")
    )
    assert wire.answer()[0] == 413
    wire.close()


def test_headers_are_capped(sched: Scheduler) -> None:
    """Regression: an 8 MiB header was accepted."""
    wire = Wire(sched)
    sender = threading.Thread(
        target=lambda: _quietly(
            wire.sock.sendall,
            request("GET", "/health", extra="X-Big: " + "a" * (8 << 20) + "\r\n", secret=False),
        ),
        daemon=True,
    )
    sender.start()
    status, _, _ = wire.answer()
    # uvicorn (h11) refuses a header block it cannot complete within its buffer: 400.
    assert status in (400, 431)
    assert wire.closed_by_server(10)
    sender.join(30)
    # Headers that arrive whole but are over 16 KiB: the service's 431.
    response = HTTP.get(f"{sched.url}/health", headers={"X-Big": "a" * (20 << 10)})
    assert response.status_code == 431
    assert response.json()["error"] == "headers_too_large"
    assert HTTP.get(f"{sched.url}/health").status_code == 200


def test_the_faster_parser_keeps_the_apps_header_cap(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    """HTTP_PARSER=httptools (no header cap of its own): the app's 16 KiB cap still
    answers 431, and calls are served."""
    sched = make_scheduler(
        HTTP_PARSER="httptools", PROVIDERS="static", STATIC_WORKERS="renderer=http://a:8080"
    )
    response = HTTP.get(f"{sched.url}/health", headers={"X-Big": "a" * (20 << 10)})
    assert response.status_code == 431 and response.json()["error"] == "headers_too_large"
    lease = sched.lease(ttl_seconds=60)
    assert sched.release(lease["lease_id"]).status_code == 204


def _quietly(call: Callable[..., object], *args: object) -> None:
    with contextlib.suppress(OSError):  # the server stopped reading: expected
        call(*args)


def test_idle_and_stalled_connections_are_closed(sched: Scheduler) -> None:
    """Regression: kept-alive and half-sent requests stayed open for ever."""
    idle = Wire(sched)
    idle.send(request("GET", "/health", secret=False))
    assert idle.answer()[0] == 200
    started = time.monotonic()
    assert idle.closed_by_server(20), "an idle kept-alive connection stayed open"
    assert time.monotonic() - started < 15
    # A body that stops halfway: 408, and the connection is closed.
    stalled = Wire(sched)
    stalled.send(request("POST", "/v1/lease", b'{"kind": "renderer"}')[:-5])
    started = time.monotonic()
    status, headers, body = stalled.answer()
    assert (status, json.loads(body)["error"]) == (408, "request_timeout")
    assert headers["connection"] == "close"
    assert stalled.closed_by_server(10)
    assert time.monotonic() - started < 30
    assert sched.leases() == []


# --- routing ---------------------------------------------------------------------------


def test_a_trailing_slash_is_a_404_not_a_redirect(sched: Scheduler) -> None:
    """Regression: the redirect copied the Host header into Location."""
    response = sched.http.get("/v1/leases/", headers={"Host": "evil.example"})
    assert response.status_code == 404
    assert "location" not in response.headers
    assert response.json()["error"] == "not_found"


def test_405_lists_every_allowed_method(sched: Scheduler) -> None:
    """Regression: Allow named the methods of the first route on the path only."""
    response = sched.http.put(f"/v1/lease/{uuid.uuid4()}")
    assert response.status_code == 405
    assert response.json()["error"] == "method_not_allowed"
    allowed = {m.strip() for m in response.headers["allow"].split(",")}
    assert allowed == {"DELETE", "GET"}


def test_whole_number_floats_are_integers(make_scheduler: Make) -> None:
    """Regression: 60.0 was refused where the schema says integer (JSON Schema admits it)."""
    sched = make_scheduler(**TWO)
    ok = sched.acquire(ttl_seconds=60.0, wait_seconds=0.0)
    assert ok.status_code == 200, ok.text
    lease = ok.json()["lease"]
    renewed = sched.http.post(f"/v1/lease/{lease['lease_id']}/renew", json={"ttl_seconds": 120.0})
    assert renewed.status_code == 200, renewed.text
    listed = sched.http.get("/v1/leases", params={"state": "active", "limit": "5.0"})
    assert listed.status_code == 200 and len(listed.json()) == 1, listed.text
    for bad in (60.5, True, "60"):
        for field in ("ttl_seconds", "wait_seconds"):
            refused = sched.acquire(**{field: bad})
            assert refused.status_code == 422, (field, bad, refused.text)
            assert refused.json()["field"] == field
        refused = sched.http.post(f"/v1/lease/{lease['lease_id']}/renew", json={"ttl_seconds": bad})
        assert refused.status_code == 422 and refused.json()["field"] == "ttl_seconds"
    assert (
        sched.http.get("/v1/leases", params={"state": "active", "limit": "5.5"}).status_code == 422
    )


def test_a_body_that_is_not_json_text_is_a_422(sched: Scheduler) -> None:
    """Regression: a body that is not UTF-8 got FastAPI's 400."""
    response = sched.http.post(
        "/v1/lease", content=b'{"kind": "\xff"}', headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 422, response.text
    assert (response.json()["error"], response.json()["field"]) == ("invalid_request", "body")


def test_a_422_names_the_real_cause_and_never_repeats_a_value(make_scheduler: Make) -> None:
    """Regression: a body nested 10,000 levels deep and a number of 5,000 digits were
    answered "not valid JSON (not UTF-8 JSON)", and an env value holding a lone surrogate
    (`\\ud800`, a JSON escape of no character) was partly echoed in the message. Each is
    now named for what it is, the value never repeated (env values are secrets)."""
    sched = make_scheduler(**ONE)
    secret = "s3cret-" + uuid.uuid4().hex
    digits = "7" * 5000
    cases = {
        "deep array": (b'{"kind":"renderer","x":' + b"[" * 10_000 + b"]" * 10_000 + b"}", "body"),
        "deep object": (b'{"kind":"renderer","x":' + b'{"a":' * 10_000 + b"}" * 10_001, "body"),
        "long number": (b'{"kind":"renderer","ttl_seconds":' + digits.encode() + b"}", "body"),
        "lone surrogate": (
            b'{"kind":"renderer","env":{"API_KEY":"' + secret.encode() + b'\\ud800tail"}}',
            "env.API_KEY",
        ),
    }
    causes = {
        "deep array": "nested too deeply",
        "deep object": "nested too deeply",
        "long number": "a number too long",
        "lone surrogate": "not valid Unicode",
    }
    for name, (body, field) in cases.items():
        response = sched.http.post(
            "/v1/lease", content=body, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 422, (name, response.text)
        answer = response.json()
        assert (answer["error"], answer["field"]) == ("invalid_request", field), (name, answer)
        assert causes[name] in answer["message"], (name, answer)
        assert "UTF-8" not in answer["message"], (name, answer)
        for value in (secret, "ud800", "tail", digits[:20]):
            assert value not in response.text, (name, value, answer)
    assert secret not in sched.log()
    # Still answered as before: a body that is not UTF-8, and plain bad JSON.
    not_utf8 = sched.http.post(
        "/v1/lease", content=b'{"kind": "\xff"}', headers={"Content-Type": "application/json"}
    )
    assert "not UTF-8" in not_utf8.json()["message"], not_utf8.text
    cut = sched.http.post(
        "/v1/lease", content=b'{"kind":', headers={"Content-Type": "application/json"}
    )
    assert "not valid JSON" in cut.json()["message"], cut.text
    assert sched.acquire(kind="renderer").status_code == 200  # and it serves on
