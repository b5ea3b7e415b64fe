"""One exception tree. Each class has a stable `code` (the `error` field of the JSON body)
and an HTTP status; the app has one handler for the base class."""

from __future__ import annotations

from typing import Any, ClassVar


class SchedulerError(Exception):
    code: ClassVar[str] = "internal_error"
    status: ClassVar[int] = 500

    def __init__(
        self, message: str, *, headers: dict[str, str] | None = None, **details: Any
    ) -> None:
        super().__init__(message)
        self.message = message
        self.details = details
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, **self.details}

    @property
    def retry_after(self) -> int | None:
        """Seconds after which a retry may succeed (the `Retry-After` header), when known."""
        value = self.headers.get("Retry-After", "")
        return int(value) if value.isdigit() else None


class DuplicateHeader(SchedulerError):
    """A header that must appear once (`header` names it) was repeated."""

    code = "duplicate_header"
    status = 400


class Unauthorized(SchedulerError):
    code = "unauthorized"
    status = 401


class Forbidden(SchedulerError):
    code = "forbidden"
    status = 403


class ClassNotAllowed(SchedulerError):
    """The request names a priority class above its owner's ceiling
    (OWNER_PRIORITY_CLASSES; UNLISTED_OWNER_MAX_CLASS for owners not listed)."""

    code = "class_not_allowed"
    status = 403


class LeaseNotFound(SchedulerError):
    code = "lease_not_found"
    status = 404


class LeaseConflict(SchedulerError):
    code = "lease_conflict"
    status = 409


class PastProviderDeadline(SchedulerError):
    """A renewal past the time its provider itself ends the worker (Modal's sandbox
    `timeout`): the lease keeps its expiry; `deadline` says when the worker goes."""

    code = "past_provider_deadline"
    status = 409


class BodyTooLarge(SchedulerError):
    code = "body_too_large"
    status = 413


class RequestTimeout(SchedulerError):
    """The request body did not arrive in time."""

    code = "request_timeout"
    status = 408


class HeadersTooLarge(SchedulerError):
    code = "headers_too_large"
    status = 431


class QuotaExceeded(SchedulerError):
    code = "quota_exceeded"
    status = 429


class TooManyGuards(SchedulerError):
    """A guard this scheduler has not recorded polled while it records as many as it may
    (MAX_GUARDS); `limit` says how many. Room comes back as silent guards are forgotten
    (GUARD_FORGET_SECONDS): `Retry-After` says when at the earliest."""

    code = "too_many_guards"
    status = 429


class BudgetExceeded(SchedulerError):
    """Every provider that could serve would break one of the owner's caps in money
    (docs/concepts/money.md#prices-and-caps); the body names the cap, the owner's figures and the
    cheapest price refused."""

    code = "budget_exceeded"
    status = 429


class InvalidRequest(SchedulerError):
    code = "invalid_request"
    status = 422


class NoProviderAvailable(SchedulerError):
    """No provider can serve the request now; `reasons` says why, per provider."""

    code = "no_provider_available"
    status = 503

    def __init__(self, message: str, *, at_capacity: bool = False, **details: Any) -> None:
        super().__init__(message, **details)
        # Whether a provider refused for capacity (waiting may help); not in the body.
        self.at_capacity = at_capacity


class Preempting(SchedulerError):
    """The lease is being preempted (docs/concepts/priorities.md#priorities-and-preemption): it is
    not renewed; its worker goes at `preempt_at`."""

    code = "preempting"
    status = 409


class WorkerLost(SchedulerError):
    """The lease ended because its worker stopped after its hand-out
    (docs/concepts/readiness-and-loss.md#a-worker-lost-after-its-hand-out): it is not renewed;
    `lost_cause` and `exit_code` say why."""

    code = "worker_lost"
    status = 409


class LineFull(SchedulerError):
    """The caller would wait for capacity, but the line has no room for it
    (MAX_WAITING_CALLERS, or its owner's share, MAX_WAITING_PER_OWNER); `limit` says
    which number was reached, `Retry-After` when a lease is due to end."""

    code = "line_full"
    status = 503


class ProvisionFailed(SchedulerError):
    """Every candidate provider failed to provision; `failures` lists each."""

    code = "provision_failed"
    status = 502


def no_lease(
    what: str, reasons: dict[str, str], failures: dict[str, str], at_capacity: bool
) -> ProvisionFailed | NoProviderAvailable:
    """Why an acquire of `what` (`kind=… gpu=…`) got no lease: 502 when a provider
    failed to provision, else 503, naming each provider's reason."""
    if failures:
        return ProvisionFailed(
            f"every candidate provider failed to provision {what}: "
            + "; ".join(f"{name}: {why}" for name, why in failures.items()),
            failures=failures,
            reasons=reasons,
        )
    return NoProviderAvailable(
        f"no provider can serve {what}: "
        + "; ".join(f"{name}: {why}" for name, why in reasons.items()),
        reasons=reasons,
        at_capacity=at_capacity,
    )


class ReleaseFailed(SchedulerError):
    code = "release_failed"
    status = 502


class StoreUnavailable(SchedulerError):
    code = "store_unavailable"
    status = 503


class NotReady(SchedulerError):
    """`GET /readyz`: this process should get no traffic now; `reasons` says why."""

    code = "not_ready"
    status = 503


class ShuttingDown(SchedulerError):
    """The scheduler is draining (SIGTERM, drain.py): it takes no acquire, and lets the
    callers waiting in line go. A retry reaches another replica (or this one, restarted)."""

    code = "shutting_down"
    status = 503
    # Soon: the retry goes out on a new connection (draining answers close theirs), which
    # the balancer sends to a replica that is ready.
    RETRY_AFTER_S = 1

    def __init__(
        self,
        message: str = "the scheduler is shutting down; retry, another replica answers",
        *,
        headers: dict[str, str] | None = None,
        **details: Any,
    ) -> None:
        super().__init__(
            message, headers=headers or {"Retry-After": str(self.RETRY_AFTER_S)}, **details
        )


# Raised by providers, translated by the service; never sent as they are.


class ProviderError(Exception):
    """A provider could not do what was asked. The message names the cause and never
    contains secrets or worker env values."""

    def __init__(self, message: str, *, transient: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.transient = transient


class ProviderUnavailable(ProviderError):
    """The backend cannot be reached at all (engine down, API unreachable)."""


class StartupError(RuntimeError):
    """The service cannot start; the message says why in one line."""


class ProviderOutOfCapacity(ProviderError):
    """The backend answered, but has no capacity for this request right now (RunPod: no
    instances of any candidate GPU type). The service treats it like a provider with no
    capacity: a `reason` of a 503 (with `Retry-After`), not a `failure` of a 502, and it
    tries the next provider. Capacity may come back, so it is transient."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=True)
