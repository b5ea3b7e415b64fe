"""When an acquire is tried again, for both clients. Only an acquire that carries an
`owner_id` and a `correlation_id` is retried: the scheduler answers a repeat of that pair
with the lease it already made (SPEC: idempotent acquire), so a retry can never make a
second worker. Any other acquire is sent once; a failure may have come after the worker
was made, and a repeat would then make another.

What is retried is what may pass within seconds: no answer at all (the scheduler
restarting, a replica gone from behind the load balancer: `SchedulerUnreachable`), the
state store unavailable (503 `store_unavailable`), a replica draining for a restart (503
`shutting_down`: the load balancer sends the retry elsewhere), and a 502, 503 or 504 that
is not the scheduler's own answer (a proxy or load balancer in front of it with no replica
ready). Never a 503 `no_provider_available`, which `wait_seconds` waits for in line, nor
any 4xx or the scheduler's own 502 `provision_failed`. Backoff and bounds come from
stamina (exponential with jitter, capped in attempts and total time)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import stamina

from openalice_scheduler.errors import SchedulerError
from openalice_scheduler.models import LeaseRequest

log = logging.getLogger(__name__)

RETRIED_CODES = frozenset(
    {
        "scheduler_unreachable",
        "store_unavailable",
        "shutting_down",
        # decoding.py's codes for a gateway's answer that is not the scheduler's JSON.
        "http_502",
        "http_503",
        "http_504",
    }
)


@dataclass(frozen=True)
class RetryPolicy:
    """How an idempotent acquire is retried. `attempts` counts the first one too; no
    retry starts once `timeout` seconds have passed since the first attempt began (an
    attempt under way is not cut short: each has its own HTTP timeouts). The wait before
    retry n is min(`wait_max`, `wait_initial` * 2^(n-1)) plus up to `wait_jitter`."""

    attempts: int = 20
    timeout: float = 60.0
    wait_initial: float = 0.25
    wait_max: float = 5.0
    wait_jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("RetryPolicy.attempts must be at least 1")
        if self.timeout <= 0 or self.wait_initial < 0 or self.wait_max < 0 or self.wait_jitter < 0:
            raise ValueError("RetryPolicy: timeout must be positive, waits not negative")


class _AcquireRetries:
    """The attempts of one acquire: iterate (`for` or `async for`) and run each attempt
    in `with attempt:`, calling `starting(attempt)` first."""

    def __init__(self, policy: RetryPolicy | None, request: LeaseRequest) -> None:
        self.request = request
        retried = policy is not None and bool(request.owner_id and request.correlation_id)
        policy = policy or RetryPolicy()
        self.attempts = policy.attempts if retried else 1
        self.last: SchedulerError | None = None
        self._context = stamina.retry_context(
            on=self._retried,
            attempts=self.attempts,
            timeout=policy.timeout,
            wait_initial=policy.wait_initial,
            wait_max=policy.wait_max,
            wait_jitter=policy.wait_jitter,
        )

    def __iter__(self) -> Iterator[stamina.Attempt]:
        return iter(self._context)

    def __aiter__(self) -> AsyncIterator[stamina.Attempt]:
        return self._context.__aiter__()

    def starting(self, attempt: stamina.Attempt) -> None:
        if attempt.num > 1 and self.last is not None:
            log.warning(
                "acquire (owner_id=%s, correlation_id=%s): attempt %d of at most %d after %s: %s",
                self.request.owner_id,
                self.request.correlation_id,
                attempt.num,
                self.attempts,
                self.last.code,
                self.last.message,
            )

    def _retried(self, exc: Exception) -> bool:
        if not isinstance(exc, SchedulerError) or exc.code not in RETRIED_CODES:
            return False
        self.last = exc
        return True
