"""Listings by state in creation order come straight off an index (no sort of 10,000
rows per GET /v1/leases).

Revision ID: 0005
Revises: 0004
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_leases_state_created", "leases", ["state", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_leases_state_created", table_name="leases")
