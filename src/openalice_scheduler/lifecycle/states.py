"""A lease's states and the moves between them, written once: what may follow what.

Every change of a lease's state is one of the moves below. The store applies a move as a
guarded update (`UPDATE … WHERE state IN <its sources>`): of two actors racing on one
lease (a release and the sweeper, two replicas), only one still finds the lease in a
source state, and the other is told it is gone. The store takes each move from here and
holds no rule of its own; the sets of states its reads select by (which hold capacity,
which are answered, paid, pooled...) are defined here too, at the end, and handed to the
store when it is opened (STATE_SETS).

    (new) ─reserve─▶ provisioning ─activate─▶ active ─release/expire─▶ releasing ─finish─▶ released
          ─assign──────────────────────────▶ active ─release at once────────────────────▶ released
          ─warm────▶ warming ─ready─▶ idle ─claim─▶ provisioning
    active ─preempt─▶ preempting ─release/expire/preempted─▶ releasing (or released at once)
    provisioning, warming ─fail─▶ failed;  idle ─recycle─▶ releasing
    active, idle, preempting ─lose─▶ released
"""

from __future__ import annotations

from openalice_scheduler.models import LeaseState
from openalice_scheduler.store import Move, StateSets

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

# What the store's reads select by, each set once (store/records.py StateSets).
# A worker exists or is being made: counts against a provider's cap and its exclusive
# devices (pool workers too); what reconciliation and the guards watch.
HOLDS_CAPACITY = (S.provisioning, S.active, S.preempting, S.releasing, S.warming, S.idle)
# Answers an idempotent replay of its request; the database's unique index on (owner_id,
# correlation_id) covers exactly these (store/schema.py IDEMPOTENCY_SCOPE).
ANSWERED = (S.provisioning, S.active)
# Counts against its owner's quota: those, and a lease being preempted (its worker runs).
HELD = (*ANSWERED, S.preempting)
# Its owner pays for it now: held, or its worker being destroyed.
PAID = (*HELD, S.releasing)
# The warm pool's workers; those ready to be claimed.
POOLED = (S.warming, S.idle)
IDLE = CLAIM.sources
# Over: no move leaves them (FINAL); the purge deletes them past retention.
ENDED = (S.released, S.failed)
# What the sweeper's moves take: expired, a release to retry, a preemption's grace over.
EXPIRING = EXPIRE.sources
RETRYING = RETRY.sources
IN_GRACE = PREEMPTED.sources

STATE_SETS = StateSets(
    holds_capacity=HOLDS_CAPACITY,
    answered=ANSWERED,
    held=HELD,
    paid=PAID,
    pooled=POOLED,
    idle=IDLE,
    ended=ENDED,
    expiring=EXPIRING,
    retrying=RETRYING,
    in_grace=IN_GRACE,
)
