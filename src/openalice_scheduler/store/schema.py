"""Table definitions the store queries. The schema itself is created and changed only by
the Alembic migrations beside this file; a test checks the two agree."""

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    text,
)

metadata = MetaData()

# Where (owner_id, correlation_id) must be unique: the leases an idempotent acquire
# returns instead of making a second worker.
IDEMPOTENCY_SCOPE = text(
    "state IN ('provisioning', 'active') AND owner_id IS NOT NULL AND correlation_id IS NOT NULL"
)

# Times are integer microseconds since the epoch (UTC): exact round trips on every
# database, cheap comparisons for the sweeper, and RFC 3339 formatting without parsing.
leases = Table(
    "leases",
    metadata,
    Column("lease_id", String(36), primary_key=True),
    Column("provider", String(64), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("gpu", String(8), nullable=False),
    Column("state", String(16), nullable=False),
    Column("endpoint", String(512), nullable=False, default=""),
    Column("provider_token", String(256), nullable=False, default=""),
    Column("owner_id", String(128)),
    Column("correlation_id", String(128)),
    Column("region", String(64)),
    Column("resource", String(128)),
    Column("ttl_seconds", Integer, nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger, nullable=False),
    Column("released_at", BigInteger),
    Column("release_reason", String(16)),
    Column("release_attempts", Integer, nullable=False, default=0),
    Column("next_attempt_at", BigInteger),
    Column("last_error", Text),
    Column("updated_at", BigInteger, nullable=False),
    # The scheduler process that provisions (or provisioned) the lease.
    Column("replica_id", String(64)),
    # Bumped by the database itself (a trigger, migration 0005) on every UPDATE of the
    # row, whoever makes it: a listing reuses a lease's encoding while this is unchanged.
    Column("revision", BigInteger, nullable=False, server_default=text("0")),
    # The engine of a local-docker fleet holding the worker (migration 0006).
    Column("host", String(64)),
    # Where the scheduler reaches the worker (providers.Worker.probe_url), kept for a
    # warm-pool worker: its hand-off and hand-ons go there (migration 0007).
    Column("probe_url", String(512)),
    # The lease's fencing token (migration 0008): strictly increasing over every lease of
    # the store, given when the row becomes a lease (a cold reserve, a warm claim) and
    # kept by renewals. Its worker is told it (LEASE_FENCE, the hand-off).
    Column("fence", BigInteger),
    # What the lease costs (migration 0010): the GPU type it got, its price in USD per
    # hour (null: unknown), when it became active (its cost counts from then) and, once
    # ended, its cost: price × (released_at - granted_at), to the microsecond.
    Column("gpu_type", String(64)),
    Column("price_per_hour", Float),
    Column("granted_at", BigInteger),
    Column("cost", Float),
    # Its caller's priority class (docs/concepts/priorities.md#priorities-and-preemption); when it
    # is being preempted, the moment its worker goes, and the request that displaces it.
    Column("priority_class", String(32), nullable=False, server_default=text("'default'")),
    Column("preempt_at", BigInteger),
    Column("preempted_by", String(300)),
    # Where the scheduler itself reaches the worker (its notices: a preemption).
    Column("worker_url", String(512)),
    # A lease whose worker stopped after its hand-out (migration 0012): why, as its
    # backend told it (models.LostCause), and its exit code when the backend gives one.
    Column("lost_cause", String(16)),
    Column("exit_code", Integer),
    # When a caller's request made the row a lease (a cold reservation, a pool worker's
    # claim); null for a pool worker never leased (migration 0014): a pool's demand.
    Column("requested_at", BigInteger),
    # When the row began as a warm-pool worker (null: never one); its time in the pool
    # (until its claim, else its end) is the pool's cost in usage (migration 0014).
    Column("pooled_at", BigInteger),
    # When that pool worker was ready: its cold start, which its pool's target covers.
    Column("pool_ready_at", BigInteger),
    Index("ix_leases_state_expires", "state", "expires_at"),
    Index("ix_leases_listing", "state", "created_at", "lease_id", "revision"),
    Index("ix_leases_provider_state", "provider", "state"),
    Index("ix_leases_owner_state", "owner_id", "state"),
    Index("ix_leases_released_at", "released_at"),
    # A warm pool's demand: the requests of the last minutes (migration 0014).
    Index("ix_leases_requested_at", "requested_at"),
    Index("ix_leases_pooled_at", "pooled_at"),
    Index(
        "ux_leases_idempotency",
        "owner_id",
        "correlation_id",
        unique=True,
        sqlite_where=IDEMPOTENCY_SCOPE,
        postgresql_where=IDEMPOTENCY_SCOPE,
    ),
)

# Scheduler processes sharing this store, with their last sign of life.
replicas = Table(
    "replicas",
    metadata,
    Column("replica_id", String(64), primary_key=True),
    Column("started_at", BigInteger, nullable=False),
    Column("heartbeat_at", BigInteger, nullable=False),
)

# Named locks with an expiry, held by one replica at a time (e.g. reconciliation).
locks = Table(
    "locks",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("holder", String(64), nullable=False),
    Column("expires_at", BigInteger, nullable=False),
)

# The state store's own name, made once by its migration. Workers carry it (a Docker
# label, a RunPod pod's env): schedulers that share a SCHEDULER_INSTANCE but not a store
# leave each other's workers alone instead of destroying them as orphans.
store_identity = Table(
    "store_identity",
    metadata,
    Column("store_id", String(36), primary_key=True),
)

# SQLite's fence counter: one row, the last fence given, moved in the transaction that
# gives the next (one writer). PostgreSQL gives fences from the SEQUENCE `lease_fence`
# instead, which holds no row lock until COMMIT; there this table stays as migrated.
fence_counter = Table(
    "fence_counter",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("last", BigInteger, nullable=False),
)

# The guards (`openalice-scheduler guard`) that watch this store's workers, with the
# providers each watches and its last contact (migration 0009).
guards = Table(
    "guards",
    metadata,
    Column("guard_id", String(128), primary_key=True),
    Column("providers", String(256), nullable=False),
    Column("last_contact_at", BigInteger, nullable=False),
)

# The callers waiting in line for capacity, on every replica (migration 0011): the line
# is one, in order of priority then arrival. `providers`: those that could serve the
# caller's request (its kind, GPU class and region); `until`: when its wait ends.
waiters = Table(
    "waiters",
    metadata,
    Column("waiter_id", String(36), primary_key=True),
    Column("replica_id", String(64), nullable=False),
    Column("owner_id", String(128)),
    Column("correlation_id", String(128)),
    Column("priority_class", String(32), nullable=False),
    Column("priority", Integer, nullable=False),
    Column("arrived_at", BigInteger, nullable=False),
    Column("kind", String(16), nullable=False),
    Column("gpu", String(8), nullable=False),
    Column("region", String(64)),
    # The providers that may serve it, in the policy's order (comma list).
    Column("providers", String(256), nullable=False),
    Column("until", BigInteger, nullable=False),
    # The lease it will have, its TTL, whether it waits at all (`wait_seconds` > 0), and
    # whether an idle pool worker may serve it.
    Column("lease_id", String(36), nullable=False),
    Column("ttl_seconds", Integer, nullable=False),
    Column("patient", Boolean, nullable=False),
    Column("pooled", Boolean, nullable=False),
    # The admission loop's decision: the lease granted, or why it was refused (JSON).
    Column("granted", String(36)),
    Column("refusal", Text),
    Column("decided_at", BigInteger),
    # Out of line (its wait ran out): its arrival kept until then for a retry.
    Column("left_until", BigInteger),
    Index("ix_waiters_replica", "replica_id", "decided_at"),
    Index("ix_waiters_request", "owner_id", "correlation_id"),
)
