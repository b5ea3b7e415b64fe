"""A lease's states and the moves between them, written once: what may follow what.

Every change of a lease's state is one of the moves below. The store applies a move as a
guarded update (`UPDATE … WHERE state IN <its sources>`): of two actors racing on one
lease (a release and the sweeper, two replicas), only one still finds the lease in a
source state, and the other is told it is gone. The store takes each move from here and
holds no rule of its own.

    (new) ─reserve─▶ provisioning ─activate─▶ active ─release/expire─▶ releasing ─finish─▶ released
          ─assign──────────────────────────▶ active ─release at once────────────────────▶ released
          ─warm────▶ warming ─ready─▶ idle ─claim─▶ provisioning
    active ─preempt─▶ preempting ─release/expire/preempted─▶ releasing (or released at once)
    provisioning, warming ─fail─▶ failed;  idle ─recycle─▶ releasing
    active, idle, preempting ─lose─▶ released
"""

from __future__ import annotations

from openalice_scheduler.models import LeaseState
from openalice_scheduler.store import Move

S = LeaseState

# New rows.
RESERVE = Move("reserve", (), S.provisioning)
ASSIGN = Move("assign", (), S.active)  # a worker that already runs: reserved and active
WARM = Move("warm", (), S.warming)  # a pool worker being made
# A lease whose provider failed, moved to the next (its fence stays).
MOVE_ON = Move("move on", (S.provisioning,), S.provisioning)
ASSIGN_MOVED = Move("assign", (S.provisioning,), S.active)
# Its worker made and ready; or never to be.
ACTIVATE = Move("activate", (S.provisioning,), S.active)
FAIL = Move("fail", (S.provisioning, S.warming), S.failed)
# The warm pool's workers: ready, taken by a request, or destroyed unused.
READY = Move("ready", (S.warming,), S.idle)
CLAIM = Move("claim", (S.idle,), S.provisioning)
RECYCLE = Move("recycle", (S.idle,), S.releasing)
# While held.
RENEW = Move("renew", (S.active,), S.active)
# Ending: claimed for one attempt to destroy the worker (a lease already `releasing` is
# claimed again: its caller wants it gone now), then released; or released at once when
# there is nothing to destroy, or when the worker is already gone.
RELEASE = Move("release", (S.active, S.preempting, S.releasing), S.releasing)
RELEASE_AT_ONCE = Move("release at once", (S.active, S.preempting, S.releasing), S.released)
EXPIRE = Move("expire", (S.active, S.preempting), S.releasing)
# Displaced by a caller of a higher class: told, given its grace, then gone.
PREEMPT = Move("preempt", (S.active,), S.preempting)
PREEMPTED = Move("preempted", (S.preempting,), S.releasing)
PREEMPTED_AT_ONCE = Move("preempted at once", (S.preempting,), S.released)
RETRY = Move("retry", (S.releasing,), S.releasing)
ATTEMPT_FAILED = Move("attempt failed", (S.releasing,), S.releasing)
FINISH = Move("finish", (S.releasing,), S.released)
LOSE = Move("lose", (S.active, S.idle, S.preempting), S.released)

MOVES = (
    RESERVE,
    ASSIGN,
    WARM,
    MOVE_ON,
    ASSIGN_MOVED,
    ACTIVATE,
    FAIL,
    READY,
    CLAIM,
    RECYCLE,
    RENEW,
    RELEASE,
    RELEASE_AT_ONCE,
    EXPIRE,
    RETRY,
    ATTEMPT_FAILED,
    FINISH,
    LOSE,
    PREEMPT,
    PREEMPTED,
    PREEMPTED_AT_ONCE,
)

# What may follow what: every (from, to) of a move.
TRANSITIONS: frozenset[tuple[LeaseState, LeaseState]] = frozenset(
    (source, move.target) for move in MOVES for source in move.sources
)
# States no move leaves.
FINAL = frozenset(S) - {source for source, _ in TRANSITIONS}

# What the admission rules count (lifecycle/admission.py, admitting.py).
# States that hold a worker: they count against caps and exclusive devices.
LIVE = frozenset(
    s.value for s in (S.provisioning, S.active, S.preempting, S.releasing, S.warming, S.idle)
)
# What answers an idempotent replay; what counts against an owner's quota (those and a
# lease being preempted, whose worker still runs); what an owner pays for now.
ANSWERED = frozenset({S.provisioning.value, S.active.value})
HELD = ANSWERED | {S.preempting.value}
PAID = HELD | {S.releasing.value}
