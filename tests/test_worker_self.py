"""What a worker knows of its lease (issue 16, item 6): LEASE_SELF_URL and LEASE_TOKEN in
its environment (and its hand-off), `GET /v1/lease/{id}/self` answering that one lease
only, and the demo worker using both: it stops itself once the scheduler is silent past
its deadline, and refuses requests with an older fence than the lease it serves."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest

from openalice_scheduler.lease_access import LeaseAccess
from tests.harness import HTTP, REPO, SECRET, WORKER_IMAGE_ENV, Scheduler, docker_client, wait_for
from tests.test_warm_pool import POOL_ENV, wait_idle, worker_page

Make = Callable[..., Scheduler]
# These tests need this checkout's demo worker: built under a tag of their own, so that
# a test session of another checkout rebuilding the shared tag cannot swap it meanwhile
# (TEST_WORKER_IMAGE's tag, when given, is already a checkout's own).
IMAGE = os.environ.get(WORKER_IMAGE_ENV) or "openalice-demo-worker:lease-self-test"


@pytest.fixture(scope="module")
def image() -> Iterator[dict[str, str]]:
    subprocess.run([str(REPO / "scripts" / "build-worker-image.sh"), IMAGE], check=True)
    yield {"RENDERER_IMAGE": IMAGE, "ANIM_IMAGE": IMAGE}


def reachable(make_scheduler: Make, image: dict[str, str], **env: str) -> tuple[Scheduler, str]:
    """A scheduler its workers reach: listening on every address, and SCHEDULER_PUBLIC_URL
    its address on the workers' network (one of its own, made first, to know its gateway)."""
    sched = make_scheduler(
        start=False,
        SCHEDULER_HOST="0.0.0.0",
        DOCKER_NETWORK=f"oa-self-{uuid.uuid4().hex[:10]}",
        **image,
        **env,
    )
    network = docker_client().networks.create(sched.env["DOCKER_NETWORK"], driver="bridge")
    gateway = network.attrs["IPAM"]["Config"][0]["Gateway"]
    public = f"http://{gateway}:{sched.port}"
    sched.env["SCHEDULER_PUBLIC_URL"] = public
    return sched.start(), public


def test_the_self_endpoint_answers_one_lease_to_its_own_token(
    make_scheduler: Make,
    image: dict[str, str],
) -> None:
    sched, public = reachable(make_scheduler, image)
    a = sched.lease(kind="renderer", owner_id="w", ttl_seconds=600)
    b = sched.lease(kind="renderer")
    env_a, env_b = _env(a["provider_token"]), _env(b["provider_token"])
    assert env_a["LEASE_SELF_URL"] == f"{public}/v1/lease/{a['lease_id']}/self"
    assert env_a["LEASE_FENCE"] == str(a["fence"])
    token_a, token_b = env_a["LEASE_TOKEN"], env_b["LEASE_TOKEN"]
    assert token_a != token_b

    own = _self(sched, a["lease_id"], token_a)
    assert own.status_code == 200, own.text
    assert own.json() == {
        "lease_id": a["lease_id"],
        "state": "active",
        "expires_at": a["expires_at"],
        "fence": a["fence"],
        "preempt_at": None,
    }
    # A renewal moves the deadline the worker reads.
    renewed = sched.http.post(
        f"/v1/lease/{a['lease_id']}/renew",
        headers={"X-Lease-Owner": "w"},
        json={"ttl_seconds": 900},
    )
    assert renewed.status_code == 200
    assert (
        _self(sched, a["lease_id"], token_a).json()["expires_at"]
        == renewed.json()["expires_at"]
        != a["expires_at"]
    )

    # Another lease's token, or a made-up one: 403, never repeated back.
    for wrong in (token_b, "not-a-token-" + uuid.uuid4().hex):
        refused = _self(sched, a["lease_id"], wrong)
        assert refused.status_code == 403
        assert refused.json()["error"] == "forbidden"
        assert wrong not in refused.text
    # No credential: 401. The internal secret works too.
    bare = HTTP.get(f"{sched.url}/v1/lease/{a['lease_id']}/self", timeout=10)
    assert bare.status_code == 401 and bare.json()["error"] == "unauthorized"
    assert sched.http.get(f"/v1/lease/{a['lease_id']}/self").json()["state"] == "active"
    # A lease token opens that one path and nothing else.
    for path in (f"/v1/lease/{a['lease_id']}", "/v1/leases", f"/v1/lease/{a['lease_id']}/self/x"):
        other = HTTP.get(
            f"{sched.url}{path}", timeout=10, headers={"Authorization": f"Bearer {token_a}"}
        )
        assert other.status_code == 401, path
    deleted = HTTP.delete(
        f"{sched.url}/v1/lease/{a['lease_id']}",
        timeout=10,
        headers={"Authorization": f"Bearer {token_a}"},
    )
    assert deleted.status_code == 401

    # Once released, the worker's question is answered "released".
    assert sched.release(a["lease_id"], owner="w").status_code == 204
    assert _self(sched, a["lease_id"], token_a).json()["state"] == "released"
    # Derived from the secret, never stored: still valid after a restart.
    sched.kill()
    sched.start()
    again = _self(sched, b["lease_id"], token_b)
    assert again.status_code == 200 and again.json()["state"] == "active"

    # Tokens appear nowhere but in the worker: not in logs, the store or metrics.
    database = sched.env["DATABASE_URL"].removeprefix("sqlite:///")
    with sqlite3.connect(database) as db:
        dump = "\n".join(db.iterdump())
    metrics = HTTP.get(f"{sched.url}/metrics", timeout=10).text
    for token in (token_a, token_b):
        assert token not in sched.log()
        assert token not in dump
        assert token not in metrics
    assert "/self" in sched.log()  # the access lines are there, without the token


def test_a_repeated_authorization_header_is_refused_as_a_repeated_secret_is(
    make_scheduler: Make,
) -> None:
    """Regression: two `Authorization` headers on a worker's own view were taken, the
    last one winning, where a repeated X-Internal-Secret is a 400: a proxy in front may
    have checked the other one. Now either order, and the same token twice, is a 400
    `duplicate_header` that repeats neither value, in its body or the log. (A static
    endpoint is told no token: the test derives it as the scheduler does.)"""
    sched = make_scheduler(PROVIDERS="static", STATIC_WORKERS="renderer=http://w:8080")
    lease = sched.lease(kind="renderer")
    token = LeaseAccess(SECRET, None).token(lease["lease_id"])
    url = f"{sched.url}/v1/lease/{lease['lease_id']}/self"
    alone = HTTP.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert alone.status_code == 200, alone.text
    made_up = "made-up-" + uuid.uuid4().hex
    for first, last in ((made_up, token), (token, made_up), (token, token)):
        sent = [("Authorization", f"Bearer {first}"), ("Authorization", f"Bearer {last}")]
        refused = HTTP.get(url, headers=sent, timeout=10)
        assert refused.status_code == 400, (first == token, refused.text)
        body = refused.json()
        assert (body["error"], body["header"]) == ("duplicate_header", "authorization")
        assert token not in refused.text and made_up not in refused.text
    assert token not in sched.log() and made_up not in sched.log()


def test_the_demo_worker_stops_itself_when_the_scheduler_dies_and_its_deadline_passes(
    make_scheduler: Make,
    image: dict[str, str],
) -> None:
    sched, _public = reachable(make_scheduler, image)
    # The renewal must reach the worker before the first TTL ends (or the scheduler ends
    # the lease): 12 s and 16 s leave a machine loaded with other tests' containers (each
    # `docker exec` below then takes a second) room for it; 8 s and 10 s once did not.
    lease = sched.lease(kind="renderer", ttl_seconds=12, env={"SELF_CHECK_SECONDS": "1"})
    container = docker_client().containers.get(lease["provider_token"])
    # The worker asks the scheduler, and learns of a renewal that way (a cold worker
    # gets no hand-on).
    wait_for(
        lambda: _asked(container).get("state") == "active",
        30,
        0.2,
        what="the worker asking after its lease",
    )
    renewed = sched.http.post(f"/v1/lease/{lease['lease_id']}/renew", json={"ttl_seconds": 16})
    assert renewed.status_code == 200
    deadline = renewed.json()["expires_at"]
    wait_for(
        lambda: _asked(container).get("expires_at") == deadline,
        30,
        0.2,
        what="the worker learning its renewal",
    )

    sched.kill()  # kill -9, not restarted; no guard runs
    wait_for(lambda: _status(container) == "exited", 90, 0.5, what="the worker stopping itself")
    state = container.attrs["State"]
    assert state["ExitCode"] == 0
    assert b"no answer from the scheduler and the lease expired" in container.logs()
    # Not before the deadline it was last told.
    assert _moment(state["FinishedAt"]) >= _moment(deadline)


def test_a_warm_worker_refuses_requests_with_the_fence_of_before_its_hand_off(
    make_scheduler: Make,
    image: dict[str, str],
) -> None:
    sched, public = reachable(make_scheduler, image, WARM_POOL="renderer/none=1", **POOL_ENV)
    wait_idle(sched, 1)
    [idle] = sched.http.get("/v1/leases", params={"state": "idle"}).json()
    env = _env(idle["provider_token"])
    assert env["LEASE_FENCE"] == str(idle["fence"])
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    assert lease["lease_id"] == idle["lease_id"] and lease["fence"] > idle["fence"]
    # The hand-off told it its new fence, with its way to the scheduler.
    handoff = worker_page(lease["provider_token"])["handoff"]
    assert handoff["fence"] == lease["fence"]
    assert handoff["self_url"] == f"{public}/v1/lease/{lease['lease_id']}/self"
    assert handoff["token"] == env["LEASE_TOKEN"]
    assert env["LEASE_TOKEN"] not in sched.log()

    work = f"{_address(lease['provider_token'])}/cgi-bin/work"
    older = HTTP.get(work, headers={"X-Lease-Fence": str(idle["fence"])}, timeout=10)
    assert older.status_code == 409
    assert older.json() == {"error": "stale_fence", "fence": lease["fence"], "given": idle["fence"]}
    current = HTTP.get(work, headers={"X-Lease-Fence": str(lease["fence"])}, timeout=10)
    assert current.status_code == 200 and current.json()["fence"] == lease["fence"]
    assert HTTP.get(work, timeout=10).status_code == 400  # no fence at all


def _self(sched: Scheduler, lease_id: str, token: str) -> httpx.Response:
    return HTTP.get(
        f"{sched.url}/v1/lease/{lease_id}/self",
        timeout=10,
        headers={"Authorization": f"Bearer {token}"},
    )


def _env(container_id: str) -> dict[str, str]:
    config = docker_client().api.inspect_container(container_id)["Config"]
    return dict(item.split("=", 1) for item in config["Env"])


def _address(container_id: str) -> str:
    networks = docker_client().api.inspect_container(container_id)["NetworkSettings"]
    [net] = networks["Networks"].values()
    return f"http://{net['IPAddress']}:8080"


def _asked(container: Any) -> dict[str, Any]:
    """The worker's latest answer from the scheduler ({} before its first)."""
    out = container.exec_run(["/bin/busybox", "cat", "/www/self.json"])
    return json.loads(out.output) if out.exit_code == 0 and out.output.strip() else {}


def _status(container: Any) -> str:
    container.reload()
    return str(container.status)


def _moment(stamp: str) -> datetime:
    """An RFC 3339 time from the scheduler or Docker (nanoseconds cut to micro)."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{whole}.{(fraction + '000000')[:6]}+00:00")
