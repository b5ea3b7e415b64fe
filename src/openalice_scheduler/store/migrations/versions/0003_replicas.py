"""Replicas: which scheduler process is provisioning a lease, whether it is alive, and a
lock so that reconciliation runs on one replica at a time.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("replica_id", sa.String(64)))
    op.create_table(
        "replicas",
        sa.Column("replica_id", sa.String(64), primary_key=True),
        sa.Column("started_at", sa.BigInteger, nullable=False),
        sa.Column("heartbeat_at", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "locks",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("holder", sa.String(64), nullable=False),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("locks")
    op.drop_table("replicas")
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("replica_id")
