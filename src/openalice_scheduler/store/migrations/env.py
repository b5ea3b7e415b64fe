"""Alembic environment: migrations always run on a connection handed over by the store
(see `store.migrate`), on SQLite and PostgreSQL alike."""

from alembic import context

from openalice_scheduler.store.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
