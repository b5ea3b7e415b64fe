"""/docs works offline: a real browser (Debian's headless Chromium) renders every
operation from the service alone, with every host but loopback out of reach; the page
and its assets come from the service, ungated; the operation ids are stable names."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import pytest

from tests.harness import HTTP, Scheduler, scheduler
from tests.pages import page_references

STATIC = {"PROVIDERS": "static", "STATIC_WORKERS": "renderer=http://a:80"}
# Each operation's id, which generated clients name their calls after: changing one
# breaks every caller's code, so a change must show up here. By path, then method, as
# the document's `paths` has them.
OPERATION_IDS = {
    "/v1/lease": {"post": "acquire_lease"},
    "/v1/lease/{lease_id}": {"get": "get_lease", "delete": "release_lease"},
    "/v1/lease/{lease_id}/renew": {"post": "renew_lease"},
    "/v1/lease/{lease_id}/events": {"get": "lease_events"},
    "/v1/lease/{lease_id}/self": {"get": "lease_self"},
    "/v1/leases": {"get": "list_leases"},
    "/v1/providers": {"get": "list_providers"},
    "/v1/pools": {"get": "list_pools"},
    "/v1/line": {"get": "waiting_line"},
    "/v1/usage": {"get": "usage"},
    "/v1/guard": {"get": "guard_poll"},
    "/health": {"get": "health"},
    "/metrics": {"get": "metrics"},
    "/readyz": {"get": "readyz"},
}
CONTENT_TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scheduler]:
    with scheduler(tmp_path_factory.mktemp("docs"), **STATIC) as sched:
        yield sched


def test_a_browser_renders_every_operation_with_nothing_beyond_loopback(
    service: Scheduler, tmp_path: Path
) -> None:
    spec = HTTP.get(f"{service.url}/openapi.json").json()
    dom, requested = _render(f"{service.url}/docs", tmp_path)
    shown = re.findall(r'class="opblock-summary-operation-id">([^<]*)<', dom)
    listed = [
        operation["operationId"]
        for operations in spec["paths"].values()
        for operation in operations.values()
    ]
    assert shown == listed and "acquire_lease" in shown, dom[:2000]
    for operations in spec["paths"].values():
        for operation in operations.values():
            assert f">{operation['summary']}<" in dom, operation["summary"]
    # Everything the page asked for, it asked of the service (a CDN fetch would be here
    # too, refused: the page might still render from what it had).
    assert requested and all(url.startswith(f"{service.url}/") for url in requested), requested
    assert {
        f"{service.url}/openapi.json",
        f"{service.url}/docs/assets/swagger-ui-bundle.js",
        f"{service.url}/docs/assets/swagger-ui.css",
    } <= set(requested), requested


def test_the_page_and_its_assets_come_from_the_service_without_the_secret(
    service: Scheduler,
) -> None:
    page = HTTP.get(f"{service.url}/docs")  # no X-Internal-Secret: ungated, as /openapi.json
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    references = page_references(page.text)
    assert len(references) >= 3, page.text  # the script, the stylesheet, the icon
    for reference in references:
        url = urljoin(f"{service.url}/docs", reference)
        assert url.startswith(f"{service.url}/docs/assets/"), reference
        asset = HTTP.get(url)
        assert asset.status_code == 200, (url, asset.status_code)
        expected = CONTENT_TYPES[Path(url).suffix]
        assert asset.headers["content-type"].split(";")[0] == expected, (url, asset.headers)
        assert len(asset.content) > 1000, url
    # ReDoc is not served: its page loads a logo from Redocly's CDN.
    redoc = HTTP.get(f"{service.url}/redoc")
    assert (redoc.status_code, redoc.json()["error"]) == (404, "not_found")
    wrong = HTTP.put(f"{service.url}/docs")
    assert (wrong.status_code, wrong.headers["allow"]) == (405, "GET"), wrong.headers
    missing = HTTP.get(f"{service.url}/docs/assets/no-such-file.js")
    assert (missing.status_code, missing.json()["error"]) == (404, "not_found")


def test_operation_ids_are_stable_unique_names(service: Scheduler) -> None:
    spec = HTTP.get(f"{service.url}/openapi.json").json()
    found = {
        (method, path): operation["operationId"]
        for path, operations in spec["paths"].items()
        for method, operation in operations.items()
    }
    named = {
        (method, path): name
        for path, names in OPERATION_IDS.items()
        for method, name in names.items()
    }
    assert len(set(found.values())) == len(found), found
    # Every operation has its name; /readyz lands with the drain work, named `readyz`.
    assert found.items() <= named.items(), found
    assert set(named) - set(found) <= {("get", "/readyz")}, found


def _render(url: str, workdir: Path) -> tuple[str, list[str]]:
    """The page's DOM once its scripts have run, and the URLs the page itself requested
    (from Chromium's NetLog: those with the page as initiator; the browser's own update
    and sign-in calls are not the page's)."""
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed (scripts/test installs it)"
    netlog = workdir / "netlog.json"
    # Every host but loopback is out of reach: names resolve to nothing, and any request
    # not to loopback (Chromium never proxies it) goes to a "proxy" on a port that is
    # bound, not listening, so refused.
    with socket.socket() as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        proxy = f"127.0.0.1:{blackhole.getsockname()[1]}"
        done = subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                f"--user-data-dir={workdir / 'profile'}",
                f"--proxy-server={proxy}",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                f"--log-net-log={netlog}",
                "--virtual-time-budget=15000",
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    log = json.loads(netlog.read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    parts = urlsplit(url)
    origin = f"{parts.scheme}://{parts.netloc}"
    requested = [
        event["params"]["url"]
        for event in log["events"]
        if event["type"] == start and event.get("params", {}).get("initiator") == origin
    ]
    return done.stdout, requested
