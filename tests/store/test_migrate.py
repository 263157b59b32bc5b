"""Schema migrations: built only by Alembic, upgradable from every earlier revision, checked at open."""

from __future__ import annotations

import pytest
from alembic import command
from sqlalchemy import func, select, text

from loraledger.errors import AuditSchemaError
from loraledger.store.audit_store import REQUESTS, write_batch
from loraledger.store.db import make_engine, write_transaction
from loraledger.store.guards import guards_present
from loraledger.store.migrate import _scripts, alembic_config, current_revision, ensure_schema, head_revision, upgrade
from tests.db_fixtures import sample_batch

EARLIER = [script.revision for script in _scripts().walk_revisions() if script.revision != head_revision()]


def drop_guard(url: str, name: str) -> None:
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TRIGGER {name}" + (" ON events" if conn.dialect.name == "postgresql" else ""))
    engine.dispose()


def test_revisions_are_dated_and_linear():
    scripts = list(_scripts().walk_revisions())
    assert head_revision() == scripts[0].revision
    assert [s.revision for s in reversed(scripts)][:2] == ["0001_initial", "0002_guards"]
    for script in scripts:
        name = script.path.rsplit("/", 1)[-1]
        assert name[:11].replace("_", "").isdigit(), f"{name} does not start with a date"


def test_nothing_but_the_migrations_creates_the_schema():
    from importlib.resources import files

    for package in ("loraledger.store", "loraledger.migrations", "loraledger.migrations.versions"):
        for path in files(package).iterdir():
            if path.name.endswith(".py"):
                assert ".create_all(" not in path.read_text(), f"{path} creates tables outside the migrations"


def test_empty_database_upgrades_to_head_with_every_guard(db_url):
    assert upgrade(db_url) == head_revision()
    engine = make_engine(db_url)
    with engine.connect() as conn:
        assert current_revision(conn) == head_revision()
        assert guards_present(conn) == []
        # no drift between the ORM models and what the migrations built
        command.check(alembic_config(conn))
    engine.dispose()


@pytest.mark.parametrize("start", EARLIER)
def test_upgrade_from_every_earlier_revision_keeps_the_rows(db_url, start):
    assert upgrade(db_url, start) == start
    engine = make_engine(db_url)
    with pytest.raises(AuditSchemaError, match=r"behind head.*loraledger db upgrade --url"):
        ensure_schema(engine, db_url)
    with write_transaction(engine) as conn:
        write_batch(conn, sample_batch(["r1", "r2"]))
    assert upgrade(db_url) == head_revision()
    with engine.connect() as conn:
        assert guards_present(conn) == []
        assert conn.execute(select(func.count()).select_from(REQUESTS)).scalar_one() == 2
    ensure_schema(engine, db_url)
    engine.dispose()


def test_ensure_schema_migrates_only_an_empty_database(db_url):
    engine = make_engine(db_url)
    ensure_schema(engine, db_url)
    with engine.connect() as conn:
        assert current_revision(conn) == head_revision()
        assert guards_present(conn) == []
    engine.dispose()


def test_a_database_with_foreign_tables_is_refused(db_url):
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE something_else (x INTEGER)")
    with pytest.raises(AuditSchemaError, match=r"something_else.*no loraledger schema revision.*db upgrade"):
        ensure_schema(engine, db_url)
    engine.dispose()


def test_missing_guards_are_refused_then_reinstalled_by_upgrade(migrated_db_url):
    drop_guard(migrated_db_url, "events_no_update")
    engine = make_engine(migrated_db_url)
    with engine.connect() as conn:
        assert guards_present(conn) == ["events_no_update"]
    with pytest.raises(AuditSchemaError, match=r"events_no_update.*run `loraledger db upgrade --url \S+`"):
        ensure_schema(engine, migrated_db_url)
    upgrade(migrated_db_url)
    with engine.connect() as conn:
        assert guards_present(conn) == []
    ensure_schema(engine, migrated_db_url)
    engine.dispose()


def test_downgrade_is_refused_and_changes_nothing(migrated_db_url):
    engine = make_engine(migrated_db_url)
    with engine.begin() as conn, pytest.raises(AuditSchemaError, match="refused"):
        command.downgrade(alembic_config(conn), "0001_initial")
    with pytest.raises(AuditSchemaError, match="downgrades are refused"):
        upgrade(migrated_db_url, "0001_initial")
    with engine.connect() as conn:
        assert current_revision(conn) == head_revision()
        assert guards_present(conn) == []
    engine.dispose()


def test_an_unknown_newer_revision_is_refused(migrated_db_url):
    engine = make_engine(migrated_db_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999_future'"))
    with pytest.raises(AuditSchemaError, match="does not know: a newer loraledger made it"):
        ensure_schema(engine, migrated_db_url)
    engine.dispose()
