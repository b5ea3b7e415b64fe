"""The guards that watch this store's workers, with their last contact (issue 16).

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "guards",
        sa.Column("guard_id", sa.String(128), primary_key=True),
        sa.Column("providers", sa.String(256), nullable=False),
        sa.Column("last_contact_at", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("guards")
