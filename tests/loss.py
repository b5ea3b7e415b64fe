"""What the tests of a worker lost after its hand-out (issue 33) look at, on every
backend: the lease as the API shows it, the wait until it has ended, how it ended, and
the renewal a lost lease answers
(docs/concepts/readiness-and-loss.md#a-worker-lost-after-its-hand-out)."""

from __future__ import annotations

from typing import Any

import httpx

from tests.harness import Scheduler, wait_for


def lease_now(sched: Scheduler, lease: dict[str, Any]) -> dict[str, Any]:
    """The lease as `GET /v1/lease/{id}` shows it now."""
    response = sched.http.get(f"/v1/lease/{lease['lease_id']}")
    assert response.status_code == 200, response.text
    return dict(response.json())


def ended(sched: Scheduler, lease: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
    """The lease once it has ended (`released`), however it ended."""
    return dict(
        wait_for(
            lambda: (now := lease_now(sched, lease))["state"] == "released" and now,
            timeout,
            0.1,
            what=f"lease {lease['lease_id']} to end",
        )
    )


def end_of(lease: dict[str, Any]) -> tuple[str, str | None, str | None, int | None]:
    """How a lease ended, as the API tells it: (state, release_reason, lost_cause,
    exit_code)."""
    return (lease["state"], lease["release_reason"], lease["lost_cause"], lease["exit_code"])


def lost(
    sched: Scheduler,
    lease: dict[str, Any],
    cause: str,
    exit_code: int | None,
    *,
    reason: str = "lost",
    timeout: float = 60,
) -> dict[str, Any]:
    """Waits until the lease has ended with its worker lost of `cause`, with `exit_code`
    (None: its provider tells none), and returns it. `reason` is `recycled` for a warm
    pool's idle worker (it was nobody's lease)."""
    now = ended(sched, lease, timeout)
    assert end_of(now) == ("released", reason, cause, exit_code), now
    return now


def renew(sched: Scheduler, lease: dict[str, Any]) -> httpx.Response:
    """A renewal of the lease by its owner (if it has one), for the lease's own TTL."""
    owner = lease.get("owner_id")
    headers = {"X-Lease-Owner": owner} if owner else {}
    return sched.http.post(f"/v1/lease/{lease['lease_id']}/renew", headers=headers)


def renewal_refused_as_lost(
    sched: Scheduler, lease: dict[str, Any], cause: str, exit_code: int | None
) -> None:
    """What the caller hears of its lost worker when it renews: 409 `worker_lost`,
    naming the cause and exit code, in its fields and in its message."""
    refused = renew(sched, lease)
    assert refused.status_code == 409, refused.text
    body = refused.json()
    assert (body["error"], body["lost_cause"], body["exit_code"]) == (
        "worker_lost",
        cause,
        exit_code,
    ), body
    assert cause in body["message"], body
