"""Caller-given strings over real HTTP: `owner_id`, `correlation_id` and `region` are
printable ASCII tokens (SPEC), so an owner always fits and matches X-Lease-Owner, and an
empty string is refused rather than taken as a second kind of "none"."""

from __future__ import annotations

from collections.abc import Callable

from tests.harness import HTTP, Scheduler

Make = Callable[..., Scheduler]
FIELDS = ("owner_id", "correlation_id", "region")
# Each of these was accepted; a lease with such an owner could never be released (the
# header is latin-1, or cannot hold the character at all), and "" slipped past the quota.
NOT_TOKENS = {
    "latin-1": "é",
    "emoji": "\N{SLIGHTLY SMILING FACE}",
    "NUL": "a\x00b",
    "newline": "job-1\n2026-01-01 00:00:00,000 INFO forged: line",
    "space": "anim service",
    "tab": "\t",
    "DEL": "\x7f",
    "empty": "",
}
EVERY_TOKEN_CHARACTER = "".join(map(chr, range(0x21, 0x7F)))  # 94 characters


def static(make_scheduler: Make, **env: str) -> Scheduler:
    workers = ",".join(f"http://w{i}:8080" for i in range(6))
    return make_scheduler(PROVIDERS="static", STATIC_WORKERS=f"renderer={workers}", **env)


def test_caller_strings_are_printable_ascii_tokens(make_scheduler: Make) -> None:
    sched = static(make_scheduler)
    for field in FIELDS:
        for name, value in NOT_TOKENS.items():
            response = sched.acquire(kind="renderer", **{field: value})
            assert response.status_code == 422, (field, name, response.text)
            body = response.json()
            assert (body["error"], body["field"]) == ("invalid_request", field), (name, body)
            assert body["message"].startswith(f"{field}: "), body
    assert sched.leases() == []

    # Every printable character but the space is fine, and such an owner can release.
    lease = sched.lease(owner_id=EVERY_TOKEN_CHARACTER, correlation_id=EVERY_TOKEN_CHARACTER)
    assert lease["owner_id"] == EVERY_TOKEN_CHARACTER
    assert sched.release(lease["lease_id"], owner=EVERY_TOKEN_CHARACTER).status_code == 204
    # A region at its 64-character limit is a valid request (just one nobody here serves).
    placed = sched.acquire(kind="renderer", region="r" * 64)
    assert placed.status_code == 503 and placed.json()["error"] == "no_provider_available"


def test_the_owner_filter_of_the_listing_follows_the_same_rule(make_scheduler: Make) -> None:
    sched = static(make_scheduler)
    lease = sched.lease(owner_id="alice")
    for name, value in NOT_TOKENS.items():
        response = sched.http.get("/v1/leases", params={"owner_id": value})
        assert response.status_code == 422, (name, response.text)
        assert response.json()["field"] == "owner_id", name
    found = sched.http.get("/v1/leases", params={"owner_id": "alice"})
    assert [x["lease_id"] for x in found.json()] == [lease["lease_id"]]


def test_empty_strings_are_refused_everywhere(make_scheduler: Make) -> None:
    sched = static(make_scheduler, MAX_LEASES_PER_OWNER="3")
    # The second of these was a 500: both hit the unique (owner_id, correlation_id) index.
    repeats = [sched.acquire(owner_id="alice", correlation_id="") for _ in range(2)]
    assert [r.status_code for r in repeats] == [422, 422], [r.text for r in repeats]
    assert {r.json()["field"] for r in repeats} == {"correlation_id"}

    # An empty owner was nobody's, so the quota never counted it: five leases with a
    # quota of three.
    anonymous = [sched.acquire(owner_id="") for _ in range(5)]
    assert [r.status_code for r in anonymous] == [422] * 5
    assert sched.leases() == []

    for job in range(3):
        sched.lease(owner_id="alice", correlation_id=f"job-{job}")
    over = sched.acquire(owner_id="alice", correlation_id="job-3")
    assert over.status_code == 429 and over.json()["error"] == "quota_exceeded"
    assert len(sched.leases()) == 3
    assert HTTP.get(f"{sched.url}/health").status_code == 200
