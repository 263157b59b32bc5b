"""Alembic environment for the audit store: runs on a connection handed in by loraledger.store.migrate."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from loraledger.store.models import Base

config = context.config


def _configure(dialect_name: str, **kwargs: object) -> None:
    context.configure(
        target_metadata=Base.metadata,
        compare_type=True,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead
        render_as_batch=dialect_name == "sqlite",
        **kwargs,
    )


def _run_on(connection: Connection) -> None:
    _configure(connection.dialect.name, connection=connection)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_on(connection)
        return
    # the plain `alembic` command: open the database ourselves, with loraledger's engine settings
    from loraledger.cli import default_url
    from loraledger.store.db import make_engine

    engine = make_engine(config.get_main_option("sqlalchemy.url") or default_url())
    try:
        with engine.connect() as conn:
            _run_on(conn)
            conn.commit()
    finally:
        engine.dispose()


def run_migrations_offline() -> None:
    from loraledger.cli import default_url
    from loraledger.store.db import normalize_url

    url = normalize_url(config.get_main_option("sqlalchemy.url") or default_url())
    _configure(url.get_backend_name(), url=url, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
