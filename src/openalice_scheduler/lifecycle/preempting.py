"""Preemption (docs/concepts/priorities.md#priorities-and-preemption): a caller of a class that
preempts, willing to wait, that found every provider full and no idle pool worker, displaces one
lease of a lower, preemptible class. Which lease, and that the room it frees is this caller's alone,
is admission's (admission.preempt, one transaction); how the victim ends is ending's
(Ending.preempted: counted, told, destroyed at its deadline)."""

from __future__ import annotations

from openalice_scheduler.lifecycle import admission, states
from openalice_scheduler.lifecycle.admission import Displacing
from openalice_scheduler.lifecycle.attempt import Attempt
from openalice_scheduler.lifecycle.core import Core
from openalice_scheduler.lifecycle.ending import Ending


async def displace(core: Core, ending: Ending, attempt: Attempt) -> bool:
    """For `attempt`'s caller, one victim on the first full provider, in the policy's
    order, where one's end makes room: the victim's worker is told at once and goes
    after the grace; its room is then the caller's (`caller.claims`). A retry of the same
    request (owner and correlation id) finds its victim again instead of another.
    Whether there was room after all (a lease ended meanwhile: try again now)."""
    caller, request = attempt.caller, attempt.request
    cls = core.priorities.classes.get(caller.priority_class)
    if cls is None or not cls.preempts or request.wait_seconds <= 0 or caller.claims:
        return False
    by = (
        f"{request.owner_id}/{request.correlation_id}"
        if request.owner_id and request.correlation_id
        else caller.waiter_id
    )
    for provider, terms in attempt.full:
        ask = Displacing(
            by=by,
            cls=cls,
            classes=core.priorities.classes,
            row=caller.row(),
            grace_us=int(core.preemption_grace * 1e6),
            now=core.now_us(),
        )
        outcome, victim = await core.store.reserve(
            attempt.new,
            admission.preempt(attempt.new, provider.name, terms, ask, states.PREEMPT),
        )
        if outcome == "room":
            return True
        if victim is None:
            continue
        caller.claims = victim.lease_id
        if outcome == "displaced":
            ending.preempted(victim, cls.name)
        return False
    return False
