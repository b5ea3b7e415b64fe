"""Python client for a running scheduler: `SchedulerClient` (sync) and
`AsyncSchedulerClient`, on httpx.

Answers come back as the wire models (`Lease`, `ProviderView`, `Health`); error answers are
raised as the typed exceptions of `errors.py`, chosen by the body's `error` code, so
`except QuotaExceeded` works the same on both sides of the wire. `lease()` holds a worker
for a block: it acquires, renews in the background at a third of the TTL, and releases on
exit, also when the block raises; it listens to the lease's event stream, so that
`on_preempt` hears of a preemption at once, and `on_lost` of a lease that ended while held. An
acquire with an `owner_id` and a `correlation_id` is retried, with backoff, while the
scheduler is unreachable or its store unavailable (`RetryPolicy`).

    with SchedulerClient() as client:  # SCHEDULER_URL, INTERNAL_SECRET
        with client.lease("renderer", ttl_seconds=300, owner_id="me") as held:
            render(held.endpoint)

The secret travels only in the `X-Internal-Secret` header: it is never logged, printed or
put in an exception. Neither are `env` values.

This package is the one place to import from. Its modules: `sync.py` and `aio.py` hold the
two clients, `core.py` builds the requests both send, `decoding.py` turns answers into
results or typed errors, `retrying.py` says when an acquire is sent again, and
`renewal.py` keeps a held lease fresh and gives it back, `listening.py` follows its events."""

from openalice_scheduler.client.aio import AsyncSchedulerClient
from openalice_scheduler.client.core import DEFAULT_TIMEOUT_S, DEFAULT_URL, SchedulerUnreachable
from openalice_scheduler.client.renewal import HeldLease, LeaseLost, PreemptNotice
from openalice_scheduler.client.retrying import RetryPolicy
from openalice_scheduler.client.sync import SchedulerClient

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_URL",
    "AsyncSchedulerClient",
    "HeldLease",
    "LeaseLost",
    "PreemptNotice",
    "RetryPolicy",
    "SchedulerClient",
    "SchedulerUnreachable",
]
