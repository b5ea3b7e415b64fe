"""Idempotent acquire and per-owner queries.

A partial unique index makes (owner_id, correlation_id) unique among live, handed-out
leases, so two replicas racing on one request can never both make a worker.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_LIVE = sa.text(
    "state IN ('provisioning', 'active') AND owner_id IS NOT NULL AND correlation_id IS NOT NULL"
)


def upgrade() -> None:
    op.create_index(
        "ux_leases_idempotency",
        "leases",
        ["owner_id", "correlation_id"],
        unique=True,
        sqlite_where=_LIVE,
        postgresql_where=_LIVE,
    )
    op.create_index("ix_leases_owner_state", "leases", ["owner_id", "state"])


def downgrade() -> None:
    op.drop_index("ix_leases_owner_state", "leases")
    op.drop_index("ux_leases_idempotency", "leases")
