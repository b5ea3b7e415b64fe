"""One admission loop (issue 36): the `waiters` table made anew for it. Each row is a
caller in line with what the loop needs to admit it on its own (the lease id it will
have, its TTL, whether it waits at all, whether an idle pool worker may serve it) and
the loop's decision, written as one guarded update: the lease it was granted, or why
it was refused. Rows are a line's, never kept past their callers: the table is dropped
and made again.

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_waiters_order", "waiters")
    op.drop_table("waiters")
    op.create_table(
        "waiters",
        sa.Column("waiter_id", sa.String(36), primary_key=True),
        sa.Column("replica_id", sa.String(64), nullable=False),
        sa.Column("owner_id", sa.String(128)),
        sa.Column("correlation_id", sa.String(128)),
        sa.Column("priority_class", sa.String(32), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("arrived_at", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("gpu", sa.String(8), nullable=False),
        sa.Column("region", sa.String(64)),
        sa.Column("providers", sa.String(256), nullable=False),
        sa.Column("until", sa.BigInteger(), nullable=False),
        sa.Column("lease_id", sa.String(36), nullable=False),
        sa.Column("ttl_seconds", sa.Integer(), nullable=False),
        sa.Column("patient", sa.Boolean(), nullable=False),
        sa.Column("pooled", sa.Boolean(), nullable=False),
        sa.Column("granted", sa.String(36)),
        sa.Column("refusal", sa.Text()),
        sa.Column("decided_at", sa.BigInteger()),
        sa.Column("left_until", sa.BigInteger()),
    )
    op.create_index("ix_waiters_replica", "waiters", ["replica_id", "decided_at"])
    op.create_index("ix_waiters_request", "waiters", ["owner_id", "correlation_id"])


def downgrade() -> None:
    op.drop_index("ix_waiters_request", "waiters")
    op.drop_index("ix_waiters_replica", "waiters")
    op.drop_table("waiters")
    op.create_table(
        "waiters",
        sa.Column("waiter_id", sa.String(36), primary_key=True),
        sa.Column("replica_id", sa.String(64), nullable=False),
        sa.Column("owner_id", sa.String(128)),
        sa.Column("correlation_id", sa.String(128)),
        sa.Column("priority_class", sa.String(32), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("arrived_at", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("gpu", sa.String(8), nullable=False),
        sa.Column("region", sa.String(64)),
        sa.Column("providers", sa.String(256), nullable=False),
        sa.Column("until", sa.BigInteger(), nullable=False),
        sa.Column("claims", sa.String(36)),
    )
    op.create_index("ix_waiters_order", "waiters", ["priority", "arrived_at"])
