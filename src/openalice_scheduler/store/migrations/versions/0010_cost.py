"""What a lease costs (issue 17): `gpu_type` (the GPU it got), `price_per_hour` (USD; null
when unknown), `granted_at` (when it became active: its cost counts from then) and, once
it ended, `cost` (price × time held). An index on `released_at` serves the purge of
leases older than LEASE_RETENTION_DAYS and usage over a period.

Rows from before have no price: null, counted as nothing. Those that were granted get
their created_at as granted_at, the nearest moment known.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("leases", sa.Column("gpu_type", sa.String(64), nullable=True))
    op.add_column("leases", sa.Column("price_per_hour", sa.Float(), nullable=True))
    op.add_column("leases", sa.Column("granted_at", sa.BigInteger(), nullable=True))
    op.add_column("leases", sa.Column("cost", sa.Float(), nullable=True))
    op.execute(
        "UPDATE leases SET granted_at = created_at "
        "WHERE state IN ('active', 'releasing', 'released')"
    )
    op.create_index("ix_leases_released_at", "leases", ["released_at"])


def downgrade() -> None:
    op.drop_index("ix_leases_released_at", "leases")
    with op.batch_alter_table("leases") as batch:
        for column in ("cost", "granted_at", "price_per_hour", "gpu_type"):
            batch.drop_column(column)
