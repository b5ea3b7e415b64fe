"""Fencing tokens (issue 16): `leases.fence`, strictly increasing over every lease of the
store. Existing rows get fences in the order they were created; the next fence given
(PostgreSQL: the SEQUENCE `lease_fence`; SQLite: the one row of `fence_counter`) starts
above them.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("leases", sa.Column("fence", sa.BigInteger(), nullable=True))
    # Both databases number rows the same way (window functions: SQLite 3.25+).
    op.execute("""
        UPDATE leases SET fence = (
            SELECT n FROM (SELECT lease_id, ROW_NUMBER() OVER (ORDER BY created_at, lease_id)
                           AS n FROM leases) AS numbered
            WHERE numbered.lease_id = leases.lease_id)""")
    last = op.get_bind().execute(sa.text("SELECT COALESCE(MAX(fence), 0) FROM leases")).scalar()
    op.create_table(
        "fence_counter",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("last", sa.BigInteger(), nullable=False),
    )
    op.execute(
        sa.text("INSERT INTO fence_counter (id, last) VALUES (1, :last)").bindparams(
            last=int(last or 0)
        )
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"CREATE SEQUENCE lease_fence AS bigint START WITH {int(last or 0) + 1}")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP SEQUENCE IF EXISTS lease_fence")
    op.drop_table("fence_counter")
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("fence")
