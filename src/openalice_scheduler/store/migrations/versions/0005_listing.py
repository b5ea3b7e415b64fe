"""Listings: a revision per lease row, bumped by the database on every UPDATE of it,
whoever makes it (the scheduler, an operator's tool), so that a listing reuses a lease's
encoding while its revision is unchanged (store/listing.py); and an index that gives a
listing its (lease_id, revision) keys in creation order without reading the rows.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "leases",
        sa.Column("revision", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute("""
            CREATE FUNCTION openalice_leases_revision() RETURNS trigger AS $$
            BEGIN NEW.revision := OLD.revision + 1; RETURN NEW; END
            $$ LANGUAGE plpgsql""")
        op.execute("""
            CREATE TRIGGER leases_revision BEFORE UPDATE ON leases FOR EACH ROW
            EXECUTE FUNCTION openalice_leases_revision()""")
    else:
        # SQLite cannot change NEW in a BEFORE trigger; the inner UPDATE changes the
        # revision, so the WHEN clause keeps it from firing again.
        op.execute("""
            CREATE TRIGGER leases_revision AFTER UPDATE ON leases FOR EACH ROW
            WHEN NEW.revision = OLD.revision
            BEGIN UPDATE leases SET revision = OLD.revision + 1
                  WHERE lease_id = NEW.lease_id; END""")
    op.create_index("ix_leases_listing", "leases", ["state", "created_at", "lease_id", "revision"])


def downgrade() -> None:
    op.drop_index("ix_leases_listing", table_name="leases")
    op.execute(
        "DROP TRIGGER IF EXISTS leases_revision"
        + (" ON leases" if op.get_bind().dialect.name == "postgresql" else "")
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS openalice_leases_revision()")
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("revision")
