"""The store's identity: one random id, made once, that workers are labelled with.

Revision ID: 0004
Revises: 0003
"""

import uuid

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "store_identity",
        sa.Column("store_id", sa.String(36), primary_key=True),
    )
    op.bulk_insert(table, [{"store_id": str(uuid.uuid4())}])


def downgrade() -> None:
    op.drop_table("store_identity")
