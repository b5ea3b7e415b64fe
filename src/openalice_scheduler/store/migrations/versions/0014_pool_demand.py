"""Warm pools that follow demand (issue 37): `requested_at`, when a caller's request made
the row a lease (a cold reservation, or the claim of a pool worker); null for a pool
worker never leased. A pool's demand is the rows requested over the last minutes, read on
every refill pass by this index. And `pooled_at`, when the row began as a pool worker
(null: never one): its time in the pool, until its claim or its end, is the pool's idle
cost in usage; with `pool_ready_at`, when it was ready, it is the cold start a pool's
target covers (its recent workers', read by the second index).

Rows from before: those with an owner were requests (a pool worker has none until it is
claimed); an owner-less request of theirs is not counted, which only ages out of the
last minutes' demand.

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("leases", sa.Column("requested_at", sa.BigInteger(), nullable=True))
    op.add_column("leases", sa.Column("pooled_at", sa.BigInteger(), nullable=True))
    op.add_column("leases", sa.Column("pool_ready_at", sa.BigInteger(), nullable=True))
    op.execute("UPDATE leases SET requested_at = created_at WHERE owner_id IS NOT NULL")
    op.create_index("ix_leases_requested_at", "leases", ["requested_at"])
    op.create_index("ix_leases_pooled_at", "leases", ["pooled_at"])


def downgrade() -> None:
    op.drop_index("ix_leases_pooled_at", table_name="leases")
    op.drop_index("ix_leases_requested_at", table_name="leases")
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("pool_ready_at")
        batch.drop_column("pooled_at")
        batch.drop_column("requested_at")
