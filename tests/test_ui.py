"""The dashboard, /ui, in a real browser: Debian's headless Chromium driven by Playwright
(pointed at that executable; Playwright's own browser download is never used), against a
real scheduler on static endpoints. Typed into as an operator would: a wrong secret, the
right one; leases acquired and released through the API show up on the page."""

from __future__ import annotations

import re
import shutil
import socket
import threading
import tomllib
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpx
import pytest
from playwright.sync_api import Browser, Locator, Page, expect, sync_playwright

from tests.harness import HTTP, REPO, SECRET, SHARED_ENGINE, Scheduler, scheduler, wait_for
from tests.pages import page_references
from tests.test_lease_features import acquire_in_thread
from tests.test_replicas import Replicas, replicas  # noqa: F401 - a fixture
from tests.test_warm_pool import POOL_ENV, wait_idle

# One renderer endpoint: a second renderer acquire waits in line until the first ends.
STATIC = {"PROVIDERS": "static", "STATIC_WORKERS": "renderer=http://r1.test:8080"}
# Printable ASCII without spaces, so a valid owner id, and markup if the page ever put
# it in as HTML.
OWNER = "<b>anim</b><img/src=x/onerror=alert(1)>"
# Generous: the page refreshes every 3 s.
SHOWN_WITHIN_MS = 15_000


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scheduler]:
    with scheduler(tmp_path_factory.mktemp("ui"), **STATIC) as sched:
        yield sched


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed (scripts/test installs it)"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield launched
        finally:
            launched.close()


def sign_in(page: Page, sched: Scheduler) -> None:
    """Open the dashboard of `sched` and sign in with the secret, as an operator does."""
    page.goto(f"{sched.url}/ui")
    page.fill("#secret", SECRET)
    page.press("#secret", "Enter")


def test_the_page_and_its_assets_come_from_the_service_without_the_secret(
    service: Scheduler,
) -> None:
    page = HTTP.get(f"{service.url}/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in page.text
    # Only the page's own script runs and only this service is called.
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy, policy
    assert "frame-ancestors 'none'" in policy, policy
    references = page_references(page.text)
    assert len(references) == 2, references  # the script and the stylesheet
    for reference in references:
        url = urljoin(f"{service.url}/ui", reference)
        assert url.startswith(f"{service.url}/ui/assets/"), reference
        asset = HTTP.get(url)
        assert asset.status_code == 200, (url, asset.status_code)
        expected = {".js": "text/javascript", ".css": "text/css"}[Path(url).suffix]
        assert asset.headers["content-type"].split(";")[0] == expected, asset.headers
    missing = HTTP.get(f"{service.url}/ui/assets/no-such-file.js")
    assert (missing.status_code, missing.json()["error"]) == (404, "not_found")
    wrong = HTTP.post(f"{service.url}/ui")
    assert (wrong.status_code, wrong.headers["allow"]) == (405, "GET"), wrong.headers
    # Not an operation of the API: generated clients get no call for it.
    assert "/ui" not in HTTP.get(f"{service.url}/openapi.json").json()["paths"]


def test_every_asset_ships_in_the_package() -> None:
    """A file added under ui/ that pyproject's package-data misses would be absent from
    every install but this checkout's."""
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["openalice_scheduler"]
    assets = sorted((REPO / "src" / "openalice_scheduler" / "ui").iterdir())
    assert {path.name for path in assets} >= {"index.html", "ui.js", "ui.css"}
    for path in assets:
        relative = path.relative_to(REPO / "src" / "openalice_scheduler").as_posix()
        assert any(fnmatch(relative, pattern) for pattern in patterns), relative


def test_recent_releases_are_listed_newest_first_on_request(service: Scheduler) -> None:
    ended = []
    for _ in range(3):
        lease = service.lease(kind="renderer", owner_id="lister")
        assert service.release(lease["lease_id"], owner="lister").status_code == 204
        ended.append(lease["lease_id"])
    params: dict[str, Any] = {"state": "released", "owner_id": "lister", "limit": 2}
    newest = service.http.get("/v1/leases", params={**params, "order": "newest"})
    assert [lease["lease_id"] for lease in newest.json()] == ended[:0:-1], newest.text
    oldest = service.http.get("/v1/leases", params=params)  # the default, as before
    assert [lease["lease_id"] for lease in oldest.json()] == ended[:2], oldest.text
    bad = service.http.get("/v1/leases", params={**params, "order": "sideways"})
    assert (bad.status_code, bad.json()["field"]) == (422, "order"), bad.text


def test_an_operator_signs_in_and_watches_leases_come_and_go(
    service: Scheduler, browser: Browser, tmp_path: Path
) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(f"{service.url}/ui")

    # A wrong secret: told so, and asked again; nothing kept.
    expect(page.locator("#login")).to_be_visible()
    page.fill("#secret", "not-the-secret")
    page.click("#login-form button[type=submit]")
    error = page.locator("#login-error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("refused this secret (401 unauthorized)")
    expect(page.locator("#login")).to_be_visible()
    expect(page.locator("#dashboard")).to_be_hidden()
    assert page.evaluate("sessionStorage.length") == 0

    page.fill("#secret", SECRET)
    page.press("#secret", "Enter")
    expect(page.locator("#dashboard")).to_be_visible()
    expect(page.locator("#login")).to_be_hidden()
    idle = page.locator('#capacity [data-use="renderer · none"] .figure')
    expect(idle).to_have_text("0 / 1")
    expect(page.locator("#live-empty")).to_be_visible()
    expect(page.locator("#spend")).to_contain_text("No prices configured")
    # A guard that polls shows up with its last contact.
    poll = service.http.get("/v1/guard", params={"guard_id": "guard-a", "providers": "static"})
    assert poll.status_code == 200, poll.text
    expect(page.locator('#health [data-guard="guard-a"]')).to_contain_text(
        "polling", timeout=SHOWN_WITHIN_MS
    )

    # A lease acquired through the API: on the page with its owner, as text, and its
    # time left counting down.
    first = service.lease(kind="renderer", owner_id=OWNER, ttl_seconds=600)
    row = page.locator(f'#live tr[data-lease-id="{first["lease_id"]}"]')
    expect(row).to_be_visible(timeout=SHOWN_WITHIN_MS)
    expect(row.locator(".owner")).to_have_text(OWNER)
    assert row.locator(".owner b, .owner img").count() == 0
    expect(row).to_contain_text("http://r1.test:8080")
    left = _seconds(row.locator(".time"))
    assert 540 < left <= 600, left
    expect(row.locator(".time")).not_to_have_text(
        row.locator(".time").text_content() or "", timeout=5000
    )
    assert _seconds(row.locator(".time")) < left
    expect(idle).to_have_text("1 / 1", timeout=SHOWN_WITHIN_MS)

    # A second caller waits in line for the one endpoint.
    waited: dict[str, httpx.Response] = {}
    waiter = threading.Thread(
        target=lambda: waited.update(
            answer=service.acquire(kind="renderer", owner_id="waiter", wait_seconds=60)
        )
    )
    waiter.start()
    try:
        expect(page.locator('#waiting [data-waiting="renderer · none"]')).to_have_text(
            re.compile(r"1 caller$"), timeout=SHOWN_WITHIN_MS
        )
        shot = tmp_path / "ui.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"dashboard screenshot: {shot}")

        # Released through the API: gone from the live leases, in the recent releases
        # with its reason; the waiting caller gets the endpoint.
        assert service.release(first["lease_id"], owner=OWNER).status_code == 204
    finally:
        waiter.join(timeout=90)
    expect(row).to_have_count(0, timeout=SHOWN_WITHIN_MS)
    ended = page.locator(f'#released tr[data-lease-id="{first["lease_id"]}"]')
    expect(ended.locator(".reason")).to_have_text("explicit", timeout=SHOWN_WITHIN_MS)
    expect(ended.locator(".owner")).to_have_text(OWNER)
    second = waited["answer"].json()["lease"]
    expect(page.locator(f'#live tr[data-lease-id="{second["lease_id"]}"] .owner')).to_have_text(
        "waiter", timeout=SHOWN_WITHIN_MS
    )
    expect(page.locator("#waiting")).to_have_text("Nobody is waiting.", timeout=SHOWN_WITHIN_MS)

    # On a phone: one column, nothing wider than the screen.
    page.set_viewport_size({"width": 390, "height": 844})
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    phone = tmp_path / "ui-phone.png"
    page.screenshot(path=str(phone), full_page=True)
    print(f"dashboard screenshot (phone): {phone}")

    # The secret: in this tab's sessionStorage only, in no URL, cookie or localStorage,
    # and sent to the service alone.
    assert page.evaluate("sessionStorage.getItem('openalice-scheduler.secret')") == SECRET
    assert page.evaluate("localStorage.length") == 0
    assert context.cookies() == []
    assert page.url == f"{service.url}/ui"
    assert requested and all(url.startswith(f"{service.url}/") for url in requested)
    assert not [url for url in requested if SECRET in url]
    page.reload()
    expect(page.locator("#dashboard")).to_be_visible()  # the same tab: still signed in
    other = browser.new_context()
    fresh = other.new_page()
    fresh.goto(f"{service.url}/ui")
    expect(fresh.locator("#login")).to_be_visible()  # another session: asked again
    other.close()
    page.click("#forget")  # and forgotten when the operator says so
    expect(page.locator("#login")).to_be_visible()
    page.wait_for_timeout(4000)  # a refresh in flight then must not store it again
    assert page.evaluate("sessionStorage.length") == 0
    expect(page.locator("#dashboard")).to_be_hidden()
    assert service.release(second["lease_id"], owner="waiter").status_code == 204
    context.close()


def test_fleet_hosts_show_their_health_and_use(browser: Browser, tmp_path: Path) -> None:
    with socket.socket() as closed:  # bound, never listening: refused
        closed.bind(("127.0.0.1", 0))
        gone = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
        sched = Scheduler(
            tmp_path,
            PROVIDERS="local-docker",
            DOCKER_HOSTS=f"cpu1={SHARED_ENGINE} max=2; gone={gone} max=1",
        )
        try:
            sched.start()
            lease = sched.lease(kind="anim", ttl_seconds=300)
            context = browser.new_context()
            page = context.new_page()
            sign_in(page, sched)
            cpu1 = page.locator('#health [data-host="cpu1"]')
            expect(cpu1).to_contain_text("healthy", timeout=SHOWN_WITHIN_MS)
            expect(cpu1).to_contain_text("1 / 2 workers", timeout=SHOWN_WITHIN_MS)
            expect(page.locator('#health [data-host="gone"]')).to_contain_text(
                "unhealthy", timeout=SHOWN_WITHIN_MS
            )
            row = page.locator(f'#live tr[data-lease-id="{lease["lease_id"]}"]')
            expect(row).to_contain_text("local-docker · cpu1")
            expect(page.locator('#capacity [data-use="anim · none"] .figure')).to_have_text(
                "1 / 3 (shared by kinds)"
            )
            shot = tmp_path / "ui-fleet.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"dashboard screenshot (fleet): {shot}")
            context.close()
            assert sched.release(lease["lease_id"]).status_code == 204
        finally:
            sched.cleanup()


def test_priced_leases_show_their_price_cost_and_spend_per_owner(
    browser: Browser, tmp_path: Path
) -> None:
    # Local Docker workers at 3.60 $/h: a second costs a tenth of a cent.
    sched = Scheduler(tmp_path, PROVIDERS="local-docker", LOCAL_DOCKER_PRICE_PER_HOUR="3.6")
    try:
        sched.start()
        held = sched.lease(kind="renderer", owner_id="anim", ttl_seconds=600)
        sched.lease(kind="anim", owner_id="render", ttl_seconds=600)
        done = sched.lease(kind="renderer", owner_id="anim", ttl_seconds=600)
        assert sched.release(done["lease_id"], owner="anim").status_code == 204
        ended_cost = sched.http.get(f"/v1/lease/{done['lease_id']}").json()["cost"]
        assert ended_cost > 0
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        sign_in(page, sched)
        row = page.locator(f'#live tr[data-lease-id="{held["lease_id"]}"]')
        expect(row.locator(".price")).to_have_text("$3.60/h", timeout=SHOWN_WITHIN_MS)
        cost = row.locator(".cost")
        expect(cost).to_have_text(re.compile(r"^\$0\.\d{4}$"), timeout=SHOWN_WITHIN_MS)
        # Cost so far grows while the lease is held.
        expect(cost).not_to_have_text(cost.text_content() or "", timeout=5000)
        ended = page.locator(f'#released tr[data-lease-id="{done["lease_id"]}"]')
        expect(ended.locator(".money")).to_have_text(f"${ended_cost:.4f}", timeout=SHOWN_WITHIN_MS)
        # Spend per owner, today and this month, from /v1/usage.
        spend = page.locator("#spend tbody tr").filter(has_text="anim")
        expect(spend).to_have_count(1, timeout=SHOWN_WITHIN_MS)
        expect(spend.locator("td").nth(1)).to_have_text(re.compile(r"^\$0\.\d*[1-9]"))
        expect(page.locator("#spend tbody tr").filter(has_text="render")).to_have_count(1)
        shot = tmp_path / "ui-priced.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"dashboard screenshot (priced; docs/ui.png): {shot}")
        context.close()
    finally:
        sched.cleanup()


def test_warm_pools_show_their_target_workers_cost_and_hits_and_spend_shows_the_pool(
    browser: Browser, tmp_path: Path
) -> None:
    sched = Scheduler(
        tmp_path,
        PROVIDERS="local-docker",
        LOCAL_DOCKER_PRICE_PER_HOUR="3.6",
        WARM_POOL="renderer/none=1",
        **POOL_ENV,
    )
    try:
        sched.start()
        wait_idle(sched, 1)
        sched.lease(kind="renderer", owner_id="live-control", ttl_seconds=600)  # warm
        wait_idle(sched, 1)  # and refilled
        context = browser.new_context()
        page = context.new_page()
        sign_in(page, sched)
        cells = page.locator('#pools tr[data-pool="renderer/none"] td')
        expected = ["renderer · none", "any", "fixed 1", "1", "1", "0", "$3.60/h", "1", "0"]
        for i, text in enumerate(expected):
            expect(cells.nth(i)).to_have_text(text, timeout=SHOWN_WITHIN_MS)
        # The price of readiness beside the owners' spend.
        expect(page.locator("#spend tbody tr").filter(has_text="pool")).to_have_count(
            1, timeout=SHOWN_WITHIN_MS
        )
        context.close()
    finally:
        sched.cleanup()


def _seconds(cell: Locator) -> int:
    """A time left as the page shows it ("9m 58s", "1h 02m 05s") in seconds."""
    text = cell.text_content() or ""
    parts = re.fullmatch(r"(?:(\d+)h )?(?:(\d+)m )?(\d+)s", text)
    assert parts, text
    hours, minutes, seconds = (int(part or 0) for part in parts.groups())
    return hours * 3600 + minutes * 60 + seconds


def test_a_preempted_lease_shows_its_class_and_deadline_and_the_line_its_classes(
    browser: Browser, tmp_path: Path
) -> None:
    sched = Scheduler(
        tmp_path,
        **STATIC,
        PRIORITY_CLASSES="live=100:preempts,default=50,anim=10:preemptible",
        UNLISTED_OWNER_MAX_CLASS="live",
        PREEMPTION_GRACE_SECONDS="600",
    ).start()
    try:
        victim = sched.lease(
            kind="renderer", owner_id="anim", priority_class="anim", ttl_seconds=3600
        )
        page = browser.new_page()
        sign_in(page, sched)
        row = page.locator(f'#live tr[data-lease-id="{victim["lease_id"]}"]')
        expect(row.locator(".class")).to_have_text("anim", timeout=SHOWN_WITHIN_MS)

        waiter = threading.Thread(
            target=lambda: sched.acquire(kind="renderer", priority_class="live", wait_seconds=60)
        )
        waiter.start()
        try:
            # The victim: its deadline instead of its time left; the live caller waits
            # for its room, shown by class.
            expect(row.locator(".time")).to_have_text(
                re.compile(r"^preempted · goes in (9|10)m"), timeout=SHOWN_WITHIN_MS
            )
            expect(page.locator('#waiting [data-waiting-class="live"]')).to_have_text(
                re.compile(r"class live.*1 caller$"), timeout=SHOWN_WITHIN_MS
            )
            shot = tmp_path / "ui-preempting.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"dashboard screenshot (preempting): {shot}")
            assert sched.release(victim["lease_id"], owner="anim").status_code == 204
        finally:
            waiter.join(timeout=90)
        expect(page.locator("#live tr .class")).to_have_text("live", timeout=SHOWN_WITHIN_MS)
        page.close()
    finally:
        sched.cleanup()


def test_the_line_across_replicas_is_listed_in_admission_order_until_served(
    browser: Browser,
    replicas: Replicas,  # noqa: F811 - the fixture
) -> None:
    """GET /v1/line on the page: each caller with its position, class, owner, correlation
    id, shape and replica, never its env. Two replicas on one PostgreSQL: the page on one
    lists the callers waiting on both, a later caller of a higher class first, and each
    caller leaves the list when it is served."""
    here, there = replicas(
        **STATIC,
        PRIORITY_CLASSES="live=100,default=50,anim=10",
        OWNER_PRIORITY_CLASSES="live-control=live,anim=anim",
    )
    holder = here.lease(kind="renderer", owner_id="holder", ttl_seconds=600)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    sign_in(page, here)
    expect(page.locator("#waiting")).to_have_text("Nobody is waiting.")

    # An anim caller waits on the other replica, then a live one on this one: the live
    # one is first in line.
    anim = acquire_in_thread(
        there,
        owner_id="anim",
        priority_class="anim",
        correlation_id=OWNER,
        env={"RENDER_TOKEN": "do-not-show-me"},
        wait_seconds=120,
    )
    wait_for(lambda: here.http.get("/v1/line").json(), 30, what="the anim caller in line")
    live = acquire_in_thread(
        here,
        owner_id="live-control",
        priority_class="live",
        correlation_id="shot-7",
        wait_seconds=120,
    )
    line = wait_for(
        lambda: (found := here.http.get("/v1/line").json()) and len(found) == 2 and found,
        30,
        what="both callers in line",
    )
    rows = page.locator("#line tbody tr")
    expect(rows).to_have_count(2, timeout=SHOWN_WITHIN_MS)
    first, second = rows.nth(0), rows.nth(1)
    expect(first.locator(".position")).to_have_text("1")
    expect(first.locator(".class")).to_have_text("live")
    expect(first.locator(".owner")).to_have_text("live-control")
    expect(first.locator(".correlation")).to_have_text("shot-7")
    expect(second.locator(".position")).to_have_text("2")
    expect(second.locator(".class")).to_have_text("anim")
    expect(second.locator(".owner")).to_have_text("anim")
    expect(second.locator(".correlation")).to_have_text(OWNER)  # as text, not markup
    assert second.locator(".correlation b, .correlation img").count() == 0
    expect(second).to_contain_text("renderer · none")
    # Each on its own replica; the time in line counting up.
    assert line[0]["replica"] != line[1]["replica"], line
    expect(first.locator(".replica")).to_have_attribute("title", f"replica {line[0]['replica']}")
    expect(second.locator(".replica")).to_have_attribute("title", f"replica {line[1]['replica']}")
    waited = second.locator(".time")
    expect(waited).not_to_have_text(waited.text_content() or "", timeout=5000)
    assert re.fullmatch(r"(\d+m )?\d+s", waited.text_content() or "")
    expect(page.locator('#waiting [data-waiting="renderer · none"]')).to_have_text(
        re.compile(r"2 callers$")
    )
    assert "do-not-show-me" not in page.content()
    shot = here.log_path.parent / "ui-line.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"dashboard screenshot (the line; docs/ui-line.png): {shot}")
    # On a phone: each caller a card, nothing wider than the screen.
    page.set_viewport_size({"width": 390, "height": 844})
    expect(second.locator(".correlation")).to_be_visible()
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    page.set_viewport_size({"width": 1280, "height": 900})

    # The room frees: the live caller is served and leaves the list; the anim caller
    # moves up, and leaves in turn.
    assert here.release(holder["lease_id"], owner="holder").status_code == 204
    served = live.response(60)
    assert served.status_code == 200, served.text
    expect(rows).to_have_count(1, timeout=SHOWN_WITHIN_MS)
    expect(rows.nth(0).locator(".class")).to_have_text("anim")
    expect(rows.nth(0).locator(".position")).to_have_text("1")
    lease = served.json()["lease"]
    assert here.release(lease["lease_id"], owner="live-control").status_code == 204
    last = anim.response(60)
    assert last.status_code == 200, last.text
    expect(page.locator("#waiting")).to_have_text("Nobody is waiting.", timeout=SHOWN_WITHIN_MS)
    assert here.release(last.json()["lease"]["lease_id"], owner="anim").status_code == 204
    page.close()
