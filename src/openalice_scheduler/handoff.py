"""The hand-off call (docs/concepts/pools.md#warm-pools): a pool worker started before its lease
existed learns the lease from `POST <worker><WARM_HANDOFF_PATH>`, JSON
`{"lease_id", "expires_at", "kind", "fence", "env"}` (and `self_url`, `token` with
SCHEDULER_PUBLIC_URL: docs/concepts/worker-self.md#what-a-worker-knows-of-its-lease), and must
answer 2xx. A renewal is handed on the same way without `env` (the worker learns its new expiry).

The body carries the caller's env values and the lease's token: they are sent to the
worker and nowhere else. What this module reports (and so what is logged) names status
codes and error types only, never the body."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from openalice_scheduler.lease_access import LeaseAccess
from openalice_scheduler.store import LeaseRecord, format_us

# A worker image without the hand-off: the path is not there (404), or the server knows
# no POST there (405; 501 from busybox httpd outside /cgi-bin).
NO_HANDOFF = frozenset({404, 405, 501})
# Where a worker is told it is preempted (docs/concepts/priorities.md#priorities-and-preemption).
PREEMPT_PATH = "/openalice/preempt"


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: bool
    # The worker's image has no hand-off (NO_HANDOFF): it cannot be used warm.
    unsupported: bool = False
    # What went wrong, in words fit for a log (status code or error type).
    problem: str = ""


class HandOff:
    """POSTs leases to pool workers; one HTTP client for every call."""

    def __init__(self, path: str, timeout: float, access: LeaseAccess | None = None) -> None:
        self.path = path
        self.timeout = timeout
        self.access = access or LeaseAccess("", None)
        self._client: httpx.AsyncClient | None = None

    async def send(self, record: LeaseRecord, env: Mapping[str, str] | None) -> Outcome:
        """Hand `record` to its worker (`env` None: a renewal's hand-on, no env)."""
        body: dict[str, object] = {
            "lease_id": record.lease_id,
            "expires_at": format_us(record.expires_at),
            "kind": record.kind,
            "fence": record.fence,
        }
        fields = self.access.spec_fields(record.lease_id)
        if fields["token"] is not None:
            body.update(fields)  # self_url, token
        if env is not None:
            body["env"] = dict(env)
        url = (record.probe_url or record.endpoint).rstrip("/") + self.path
        try:
            response = await self.open().post(
                url,
                content=json.dumps(body, separators=(",", ":")).encode(),
                headers={"Content-Type": "application/json"},
                timeout=self.timeout,
            )
        except httpx.HTTPError as exc:
            return Outcome(False, problem=f"POST {url}: {type(exc).__name__}")
        if response.is_success:
            return Outcome(True)
        return Outcome(
            False,
            unsupported=response.status_code in NO_HANDOFF,
            problem=f"POST {url}: {response.status_code}",
        )

    async def preempt(self, record: LeaseRecord) -> Outcome:
        """Tell `record`'s worker it is preempted: `POST <worker>/openalice/preempt`,
        JSON `{"lease_id", "fence", "preempt_at"}`
        (docs/concepts/priorities.md#priorities-and-preemption)."""
        assert record.preempt_at is not None
        body = {
            "lease_id": record.lease_id,
            "fence": record.fence,
            "preempt_at": format_us(record.preempt_at),
        }
        where = record.worker_url or record.probe_url or record.endpoint
        url = where.rstrip("/") + PREEMPT_PATH
        try:
            response = await self.open().post(url, json=body, timeout=self.timeout)
        except httpx.HTTPError as exc:
            return Outcome(False, problem=f"POST {url}: {type(exc).__name__}")
        if response.is_success:
            return Outcome(True)
        return Outcome(False, problem=f"POST {url}: {response.status_code}")

    def open(self) -> httpx.AsyncClient:
        """The client, made on first use. Making it loads the CA bundle (tens of ms): a
        scheduler with pools opens it at start, not in its first warm acquire."""
        if self._client is None:
            self._client = httpx.AsyncClient(follow_redirects=False)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
