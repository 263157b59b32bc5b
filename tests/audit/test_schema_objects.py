"""verify checks the views, not only the rows: a view redefined to hide rows, or dropped, fails it (on SQLite and
PostgreSQL)."""

from __future__ import annotations

from sqlalchemy import text

from loraledger.audit import AuditLog
from loraledger.audit.schema_objects import VIEWS, expected_view
from loraledger.store.db import make_engine
from tests.audit.synth import SynthLog


def _run(url: str, *statements: str) -> None:
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            for sql in statements:
                conn.execute(text(sql))
    finally:
        engine.dispose()


def _verify(url: str):
    with AuditLog(url) as log:
        return log.verify()


def test_the_migrated_views_verify(migrated_db_url: str, synth: SynthLog):
    result = _verify(migrated_db_url)
    assert result.ok, result.problems


def test_a_filtering_view_fails_verify(migrated_db_url: str, synth: SynthLog):
    dialect = "postgresql" if migrated_db_url.startswith("postgresql") else "sqlite"
    original = expected_view("request_lineage", dialect)
    hiding = original + " WHERE r.tenant IS NULL"
    before = _count(migrated_db_url)
    _run(migrated_db_url, "DROP VIEW request_lineage", hiding)
    assert _count(migrated_db_url) < before  # the view now hides rows
    result = _verify(migrated_db_url)
    assert not result.ok
    assert any("view request_lineage has a definition other than" in p.message for p in result.problems)


def test_a_dropped_view_fails_verify(migrated_db_url: str, synth: SynthLog):
    _run(migrated_db_url, "DROP VIEW adapter_usage")
    messages = [p.message for p in _verify(migrated_db_url).problems]
    assert any("view adapter_usage is missing" in m for m in messages)


def test_every_view_has_an_expected_definition():
    for name in VIEWS:
        for dialect in ("sqlite", "postgresql"):
            assert expected_view(name, dialect).startswith(f"CREATE VIEW {name} AS")


def _count(url: str) -> int:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT count(*) FROM request_lineage")).scalar_one()
    finally:
        engine.dispose()


def _dialect(url: str) -> str:
    return "postgresql" if url.startswith("postgresql") else "sqlite"


def test_a_dropped_guard_fails_verify(migrated_db_url: str, synth: SynthLog):
    on = " ON completions" if _dialect(migrated_db_url) == "postgresql" else ""
    _run(migrated_db_url, f"DROP TRIGGER completions_no_update{on}")
    messages = [p.message for p in _verify(migrated_db_url).problems]
    assert any("append-only guard completions_no_update is not as the migrations created it" in m for m in messages)


def test_an_altered_guard_fails_verify(migrated_db_url: str, synth: SynthLog):
    if _dialect(migrated_db_url) == "postgresql":
        # the guard function now lets every change through: the trigger is there, its function is not ours
        statements = [
            "CREATE OR REPLACE FUNCTION loraledger_refuse_change() RETURNS trigger LANGUAGE plpgsql "
            "AS $$BEGIN RETURN NEW; END$$"
        ]
        name = "its function loraledger_refuse_change() was altered"
    else:
        statements = [
            "DROP TRIGGER events_no_delete",
            "CREATE TRIGGER events_no_delete BEFORE DELETE ON events WHEN 0 BEGIN SELECT RAISE(ABORT, 'no'); END",
        ]
        name = "events_no_delete"
    _run(migrated_db_url, *statements)
    messages = [p.message for p in _verify(migrated_db_url).problems]
    assert any("append-only guard" in m and name in m for m in messages), messages


def test_a_trigger_no_migration_made_fails_verify(migrated_db_url: str, synth: SynthLog):
    if _dialect(migrated_db_url) == "postgresql":
        statements = [
            "CREATE FUNCTION drop_rows() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RETURN NULL; END$$",
            "CREATE TRIGGER quiet BEFORE INSERT ON completions FOR EACH ROW EXECUTE FUNCTION drop_rows()",
        ]
    else:
        statements = ["CREATE TRIGGER quiet BEFORE INSERT ON completions BEGIN SELECT RAISE(IGNORE); END"]
    _run(migrated_db_url, *statements)
    messages = [p.message for p in _verify(migrated_db_url).problems]
    assert any("trigger quiet on completions was not created by any migration" in m for m in messages), messages
