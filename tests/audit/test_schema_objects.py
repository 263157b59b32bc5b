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
