"""A worker lost after its hand-out (issue 33): why it stopped (`lost_cause`, one of
models.LostCause) and its exit code, kept with the lease that ended for it.

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("leases", sa.Column("lost_cause", sa.String(16), nullable=True))
    op.add_column("leases", sa.Column("exit_code", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        for column in ("exit_code", "lost_cause"):
            batch.drop_column(column)
