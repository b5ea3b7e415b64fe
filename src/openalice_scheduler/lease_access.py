"""What a worker may ask of its own lease
(docs/concepts/worker-self.md#what-a-worker-knows-of-its-lease): a URL and a token scoped to that
one lease, for `GET /v1/lease/{id}/self`.

The token is derived, never stored: HMAC-SHA256 of the lease id keyed by
INTERNAL_SECRET. So every replica can check it, a restart keeps it valid, and the secret
cannot be recovered from it. It is a credential of that one lease: it goes to the worker
(its environment, its hand-off) and nowhere else, never to a log, span, metric, error
body or the store."""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import TypedDict

# A lease's own view, the one path a lease token opens (SecretGate, api/middleware.py).
SELF_PATH = re.compile(r"/v1/lease/([^/]+)/self")
# Distinguishes these tokens from any other HMAC one might key with the same secret.
_PURPOSE = b"openalice-scheduler lease self v1:"


class WorkerAccess(TypedDict):
    """A worker's way to its own lease: WorkerSpec's `self_url` and `token`."""

    self_url: str | None
    token: str | None


class LeaseAccess:
    """Makes and checks lease tokens; `public_url` (SCHEDULER_PUBLIC_URL) is where
    workers reach the scheduler, None when they are not told."""

    def __init__(self, secret: str, public_url: str | None) -> None:
        self._key = secret.encode()
        self.public_url = public_url.rstrip("/") if public_url else None

    def token(self, lease_id: str) -> str:
        return hmac.new(self._key, _PURPOSE + lease_id.encode(), hashlib.sha256).hexdigest()

    def valid(self, lease_id: str, token: bytes) -> bool:
        """Whether `token` is the one of `lease_id` (in constant time)."""
        return hmac.compare_digest(token, self.token(lease_id).encode())

    def spec_fields(self, lease_id: str) -> WorkerAccess:
        """`self_url` and `token` of a lease's WorkerSpec (LEASE_SELF_URL, LEASE_TOKEN);
        None without a public URL: a worker that cannot reach the scheduler is given no
        credential."""
        if self.public_url is None:
            return {"self_url": None, "token": None}
        return {
            "self_url": f"{self.public_url}/v1/lease/{lease_id}/self",
            "token": self.token(lease_id),
        }
