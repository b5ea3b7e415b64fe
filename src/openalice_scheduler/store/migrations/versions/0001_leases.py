"""Leases table.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "leases",
        sa.Column("lease_id", sa.String(36), primary_key=True),
        sa.Column("provider", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("gpu", sa.String(8), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("endpoint", sa.String(512), nullable=False),
        sa.Column("provider_token", sa.String(256), nullable=False),
        sa.Column("owner_id", sa.String(128)),
        sa.Column("correlation_id", sa.String(128)),
        sa.Column("region", sa.String(64)),
        sa.Column("resource", sa.String(128)),
        sa.Column("ttl_seconds", sa.Integer, nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
        sa.Column("released_at", sa.BigInteger),
        sa.Column("release_reason", sa.String(16)),
        sa.Column("release_attempts", sa.Integer, nullable=False),
        sa.Column("next_attempt_at", sa.BigInteger),
        sa.Column("last_error", sa.Text),
        sa.Column("updated_at", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_leases_state_expires", "leases", ["state", "expires_at"])
    op.create_index("ix_leases_provider_state", "leases", ["provider", "state"])


def downgrade() -> None:
    op.drop_table("leases")
