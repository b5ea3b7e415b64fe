"""The Python client against the real service over HTTP (the static provider: no Docker
workers needed, except for the one provision failure)."""

from __future__ import annotations

import asyncio
import time
import traceback
import uuid
from collections.abc import Callable, Iterator

import pytest

from openalice_scheduler.client import AsyncSchedulerClient, SchedulerClient, SchedulerUnreachable
from openalice_scheduler.errors import (
    Forbidden,
    InvalidRequest,
    LeaseNotFound,
    NoProviderAvailable,
    ProvisionFailed,
    QuotaExceeded,
    SchedulerError,
    Unauthorized,
)
from openalice_scheduler.models import LeaseState, ReleaseReason
from tests.harness import SECRET, Scheduler, free_port

STATIC_WORKERS = "renderer=http://a:8080,http://b:8080;anim=http://c:9000"
ENV_VALUE = "env-value-" + uuid.uuid4().hex


@pytest.fixture
def static(make_scheduler: Callable[..., Scheduler]) -> Scheduler:
    # A one-second sweep, so that a lease nobody renews really ends within the tests.
    return make_scheduler(PROVIDERS="static", STATIC_WORKERS=STATIC_WORKERS,
                          SWEEP_INTERVAL_SECONDS="1")


@pytest.fixture
def client(static: Scheduler) -> Iterator[SchedulerClient]:
    with SchedulerClient(static.url, SECRET) as c:
        yield c


def test_client_round_trip(static: Scheduler, client: SchedulerClient) -> None:
    lease = client.acquire("renderer", ttl_seconds=600, owner_id="me", correlation_id="job-1",
                           env={"TOKEN": ENV_VALUE})
    assert lease.endpoint in ("http://a:8080", "http://b:8080")
    assert (lease.owner_id, lease.correlation_id, lease.state) == ("me", "job-1",
                                                                  LeaseState.active)
    assert client.get(lease.lease_id) == lease
    assert [x.lease_id for x in client.list()] == [lease.lease_id]
    assert [x.lease_id for x in client.list(owner_id="me", kind="renderer")] == [lease.lease_id]
    assert client.list(owner_id="someone-else") == []
    assert client.list(state=["released", "failed"]) == []

    # Without a TTL, the lease's own (600 s) counts again from now.
    assert client.renew(lease).expires_at > lease.expires_at
    renewed = client.renew(lease, ttl_seconds=1200)
    assert renewed.expires_at > lease.expires_at
    [view] = client.providers()
    assert (view.name, view.healthy, view.in_use) == ("static", True, 1)
    assert client.health().status == "ok"

    # The owner is required on release, and the client sends it without being told.
    assert static.release(lease.lease_id).status_code == 403
    client.release(lease.lease_id)
    gone = client.get(lease.lease_id)
    assert (gone.state, gone.release_reason) == (LeaseState.released, ReleaseReason.explicit)
    assert client.list() == []
    assert [x.lease_id for x in client.list(state=LeaseState.released)] == [lease.lease_id]
    assert ENV_VALUE not in repr(client) and SECRET not in repr(client)


def test_errors_are_typed_by_code(static: Scheduler, client: SchedulerClient) -> None:
    with SchedulerClient(static.url, "wrong-secret") as stranger, \
            pytest.raises(Unauthorized) as unauthorized:
        stranger.list()
    assert unauthorized.value.status == 401
    assert SECRET not in str(unauthorized.value)

    with pytest.raises(LeaseNotFound) as not_found:
        client.get(str(uuid.uuid4()))
    assert (not_found.value.status, not_found.value.code) == (404, "lease_not_found")

    owned = client.acquire("renderer", owner_id="me")
    with SchedulerClient(static.url, SECRET) as other:
        with pytest.raises(Forbidden) as forbidden:
            other.release(owned.lease_id)
        assert forbidden.value.status == 403
        other.release(owned.lease_id, owner="me")
    with pytest.raises(LeaseNotFound):
        client.renew(owned)

    # Refused by the service, and by the client before sending: the same class.
    with pytest.raises(InvalidRequest) as bad_filter:
        client.list(state="bogus")
    assert (bad_filter.value.status, bad_filter.value.details["field"]) == (422, "state.0")
    with pytest.raises(InvalidRequest) as bad_ttl:
        client.acquire("renderer", ttl_seconds=0)
    assert bad_ttl.value.details["field"] == "ttl_seconds"
    with pytest.raises(InvalidRequest) as bad_env:
        client.acquire("renderer", env={"bad-key": ENV_VALUE})
    assert "bad-key" in str(bad_env.value)
    assert ENV_VALUE not in "".join(traceback.format_exception(bad_env.value))
    with pytest.raises(InvalidRequest) as no_id:
        client.get("")
    assert no_id.value.details["field"] == "lease_id"

    client.acquire("anim")
    with pytest.raises(NoProviderAvailable) as no_capacity:
        client.acquire("anim")
    assert no_capacity.value.status == 503
    assert no_capacity.value.retry_after is not None and 1 <= no_capacity.value.retry_after <= 300
    assert "static" in no_capacity.value.details["reasons"]

    with SchedulerClient(f"http://127.0.0.1:{free_port()}", SECRET) as nowhere, \
            pytest.raises(SchedulerError) as unreachable:
        nowhere.providers()
    assert isinstance(unreachable.value, SchedulerUnreachable)


def test_the_client_refuses_strings_no_lease_can_carry(static: Scheduler,
                                                      client: SchedulerClient) -> None:
    # Before the rule, the first of these made a lease that release() could never give
    # back: httpx raised UnicodeEncodeError on the X-Lease-Owner header.
    for bad in ("é", "\N{SLIGHTLY SMILING FACE}", "a\nb", "a\x00b", "anim service", ""):
        with pytest.raises(InvalidRequest) as refused:
            client.acquire("renderer", owner_id=bad)
        assert refused.value.details["field"] == "owner_id", repr(bad)
    for field in ("correlation_id", "region"):
        with pytest.raises(InvalidRequest) as refused:
            client.acquire("renderer", **{field: "é"})  # type: ignore[arg-type]
        assert refused.value.details["field"] == field
    assert static.leases() == []

    lease = client.acquire("renderer", owner_id="me")
    for bad in ("é", "\N{SLIGHTLY SMILING FACE}", "a\nb", ""):
        with pytest.raises(InvalidRequest) as release:
            client.release(lease, owner=bad)
        assert release.value.details["field"] == "owner", repr(bad)
        with pytest.raises(InvalidRequest):
            client.renew(lease, owner=bad)
    with pytest.raises(InvalidRequest) as listing:
        client.list(owner_id="é")
    assert listing.value.details["field"] == "owner_id"
    assert client.get(lease).state == LeaseState.active
    client.release(lease)  # with the owner it was acquired with
    assert client.get(lease).state == LeaseState.released


async def test_the_async_client_refuses_an_owner_that_cannot_be_a_header(
    static: Scheduler,
) -> None:
    async with AsyncSchedulerClient(static.url, SECRET) as client:
        lease = await client.acquire("renderer", owner_id="me")
        with pytest.raises(InvalidRequest):
            await client.release(lease, owner="é")
        with pytest.raises(InvalidRequest):
            await client.renew(lease, owner="a\r\nX-Injected: 1")
        await client.release(lease)


def test_quota_is_429(make_scheduler: Callable[..., Scheduler]) -> None:
    sched = make_scheduler(PROVIDERS="static", STATIC_WORKERS=STATIC_WORKERS,
                           MAX_LEASES_PER_OWNER="1")
    with SchedulerClient(sched.url, SECRET) as client:
        client.acquire("renderer", owner_id="greedy")
        with pytest.raises(QuotaExceeded) as quota:
            client.acquire("renderer", owner_id="greedy")
        assert (quota.value.status, quota.value.details["limit"]) == (429, 1)
        assert client.acquire("renderer", owner_id="modest").owner_id == "modest"


def test_provision_failure_is_502(make_scheduler: Callable[..., Scheduler]) -> None:
    sched = make_scheduler(PROVIDERS="local-docker", RENDERER_IMAGE="openalice-missing:never")
    with SchedulerClient(sched.url, SECRET) as client, \
            pytest.raises(ProvisionFailed) as failed:
        client.acquire("renderer")
    assert failed.value.status == 502
    assert "openalice-missing:never" in failed.value.details["failures"]["local-docker"]


def test_lease_context_renews_in_the_background(static: Scheduler,
                                                client: SchedulerClient) -> None:
    # The control: the same TTL, not renewed, ends within the hold.
    unrenewed = client.acquire("renderer", ttl_seconds=3)
    with client.lease("renderer", ttl_seconds=3, owner_id="me") as held:
        first_expiry = held.expires_at
        time.sleep(7)
        now = static.http.get(f"/v1/lease/{held.lease_id}").json()
        assert now["state"] == "active"
        assert now["expires_at"] > first_expiry
        assert held.renewals >= 2 and not held.lost and held.error is None
    assert client.get(unrenewed).release_reason == ReleaseReason.expired
    after = client.get(held.lease_id)
    assert (after.state, after.release_reason) == (LeaseState.released, ReleaseReason.explicit)


def test_lease_context_releases_when_the_block_raises(client: SchedulerClient) -> None:
    with pytest.raises(RuntimeError, match="render crashed"), \
            client.lease("anim", ttl_seconds=600, owner_id="me") as held:
        assert client.get(held.lease_id).state == LeaseState.active
        raise RuntimeError("render crashed")
    assert client.get(held.lease_id).release_reason == ReleaseReason.explicit
    # The one anim endpoint is free again.
    assert client.acquire("anim").endpoint == "http://c:9000"


async def test_async_client(static: Scheduler) -> None:
    async with AsyncSchedulerClient(static.url, SECRET) as client:
        lease = await client.acquire("renderer", ttl_seconds=600, owner_id="me")
        assert (await client.get(lease.lease_id)).endpoint == lease.endpoint
        assert [x.lease_id for x in await client.list(owner_id="me")] == [lease.lease_id]
        assert (await client.renew(lease, ttl_seconds=900)).expires_at > lease.expires_at
        assert (await client.providers())[0].in_use == 1
        await client.release(lease)
        with pytest.raises(LeaseNotFound):
            await client.release(lease)

        async with client.lease("renderer", ttl_seconds=3, owner_id="me") as held:
            first_expiry = held.expires_at
            await asyncio.sleep(5)
            now = static.http.get(f"/v1/lease/{held.lease_id}").json()
            assert now["state"] == "active" and now["expires_at"] > first_expiry
            assert held.renewals >= 1
        assert (await client.get(held.lease_id)).release_reason == ReleaseReason.explicit

        with pytest.raises(RuntimeError, match="boom"):
            async with client.lease("anim", ttl_seconds=600) as failing:
                raise RuntimeError("boom")
        assert (await client.get(failing.lease_id)).state == LeaseState.released

        await client.acquire("anim")
        with pytest.raises(NoProviderAvailable) as no_capacity:
            await client.acquire("anim")
        assert no_capacity.value.retry_after is not None
