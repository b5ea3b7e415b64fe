"""Callers with priorities (issue 25): each lease's `priority_class` (`default` for
those from before), and for one being preempted `preempt_at` (when its worker goes) and
`preempted_by` (the request that displaces it); `worker_url`, where the scheduler
reaches the worker itself; the `waiters` table, the one line of callers waiting for
capacity across replicas.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "leases",
        sa.Column(
            "priority_class", sa.String(32), nullable=False, server_default=sa.text("'default'")
        ),
    )
    op.add_column("leases", sa.Column("preempt_at", sa.BigInteger(), nullable=True))
    op.add_column("leases", sa.Column("preempted_by", sa.String(300), nullable=True))
    op.add_column("leases", sa.Column("worker_url", sa.String(512), nullable=True))
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


def downgrade() -> None:
    op.drop_index("ix_waiters_order", "waiters")
    op.drop_table("waiters")
    with op.batch_alter_table("leases") as batch:
        for column in ("worker_url", "preempted_by", "preempt_at", "priority_class"):
            batch.drop_column(column)
