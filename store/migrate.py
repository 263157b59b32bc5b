"""Schema versions: Alembic upgrades, the current and head revisions, and the check run at every open."""

from __future__ import annotations

import functools
from importlib.resources import files

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, Engine, inspect, text
from sqlalchemy.engine import URL

from loraledger.errors import AuditSchemaError
from loraledger.store import guards
from loraledger.store.db import display_url, make_engine, take_writer_lock, unavailable_as_error, write_transaction
from loraledger.store.guards import guards_present

__all__ = [
    "alembic_config",
    "current_revision",
    "ensure_schema",
    "guards_present",
    "head_revision",
    "schema_problems",
    "upgrade",
    "upgrade_command",
]

VERSION_TABLE = "alembic_version"


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic configured in code: the revisions shipped in loraledger.migrations, run on connection."""
    cfg = Config()
    cfg.set_main_option("script_location", str(files("loraledger.migrations")))
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option("file_template", "%%(year)d_%%(month).2d_%%(day).2d_%%(rev)s_%%(slug)s")
    cfg.attributes["connection"] = connection
    return cfg


@functools.cache
def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    """The newest revision this version of loraledger ships."""
    head = _scripts().get_current_head()
    assert head is not None, "loraledger.migrations has no revisions"
    return head


def _known(revision: str) -> bool:
    return any(script.revision == revision for script in _scripts().walk_revisions())


def _ancestors(revision: str) -> set[str]:
    if not _known(revision):
        return set()
    return {script.revision for script in _scripts().iterate_revisions(revision, "base")}


def _current(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def current_revision(bind: Engine | Connection) -> str | None:
    """The database's revision; None for a database loraledger has never migrated."""
    if isinstance(bind, Connection):
        return _current(bind)
    with bind.connect() as conn:
        return _current(conn)


def upgrade_command(url: str | URL) -> str:
    return f"loraledger db upgrade --url {display_url(url)}"


def schema_problems(conn: Connection, url: str | URL) -> list[str]:
    """What keeps the database from being a usable audit store at head, each with its fix;
    empty when it is one."""
    fix = f"run `{upgrade_command(url)}`"
    current = _current(conn)
    if current is None:
        tables = sorted(set(inspect(conn).get_table_names()) - {VERSION_TABLE})
        if not tables:
            return [f"it has no audit schema yet (an empty database): {fix}"]
        return [f"it has tables ({', '.join(tables)}) but no loraledger schema revision: {fix}"]
    head = head_revision()
    if current != head:
        if not _known(current):
            return [
                f"it is at revision {current!r}, which this loraledger (head {head!r}) does not know: "
                "a newer loraledger made it, so use that version"
            ]
        return [f"its schema is at revision {current!r}, behind head {head!r}: {fix}"]
    missing = guards_present(conn)
    if missing:
        return [f"append-only guards are missing or altered ({', '.join(missing)}): {fix}"]
    return []


def _is_empty(conn: Connection) -> bool:
    return _current(conn) is None and not set(inspect(conn).get_table_names()) - {VERSION_TABLE}


def ensure_schema(engine: Engine, url: str | URL, *, deadline_s: float | None = None) -> None:
    """Make a brand-new empty database an audit store (through the migrations); refuse any other
    database that is not at head with every guard in place, naming the upgrade command.

    deadline_s (PostgreSQL): the server-side deadlines of this one transaction. The engine's connections carry
    its audit_timeout, a deadline sized for one group commit; migrating a new database runs many DDL statements
    with Python work between them, which on a busy machine can leave the transaction idle for longer than that."""
    with unavailable_as_error(url), write_transaction(engine, lock=False) as conn:
        if deadline_s is not None and conn.dialect.name == "postgresql":
            ms = max(1, round(deadline_s * 1000))
            for setting in ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout"):
                conn.execute(text(f"SET LOCAL {setting} = {ms}"))  # this transaction only: the pool keeps its own
        take_writer_lock(conn)
        # under the writer lock, so two engines opening one new database migrate it once
        if _is_empty(conn):
            command.upgrade(alembic_config(conn), "head")
            return
        problems = schema_problems(conn, url)
    if problems:
        raise AuditSchemaError(f"the audit database at {display_url(url)} cannot be used: {'; '.join(problems)}")


def upgrade(url: str | URL, revision: str = "head") -> str | None:
    """Upgrade the database at url to revision (reinstalling missing guards at head); returns
    the revision it is at afterwards. Downgrades are refused: the audit log is append-only."""
    with unavailable_as_error(url):
        engine = make_engine(url)
    try:
        with unavailable_as_error(url), write_transaction(engine) as conn:
            before = _current(conn)
            if before is not None and revision != before and revision in _ancestors(before):
                raise AuditSchemaError(
                    f"the audit database at {display_url(url)} is at {before!r}, past {revision!r}: "
                    "downgrades are refused (the audit log is append-only); restore a backup instead"
                )
            try:
                command.upgrade(alembic_config(conn), revision)
            except CommandError as exc:
                raise AuditSchemaError(
                    f"cannot upgrade the audit database at {display_url(url)} to {revision!r}: {exc}"
                ) from exc
            current = _current(conn)
            if current == head_revision() and guards_present(conn):
                guards.install(conn.exec_driver_sql, conn.dialect.name)
            return current
    finally:
        engine.dispose()
