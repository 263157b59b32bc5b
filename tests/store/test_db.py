"""make_engine / default_audit_url / write_transaction: connection settings for both dialects."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from loraledger.errors import ConfigError
from loraledger.paths import data_dir
from loraledger.store.db import default_audit_url, display_url, make_engine, normalize_url, write_transaction


def test_default_url_is_a_sqlite_file_in_the_data_dir():
    url = default_audit_url()
    assert url.startswith("sqlite:///")
    assert Path(url.removeprefix("sqlite:///")).parent == data_dir()  # under $LORALEDGER_HOME in the suite


@pytest.mark.parametrize("scheme", ["postgresql", "postgres", "postgresql+psycopg"])
def test_postgres_urls_use_psycopg_3(scheme):
    assert normalize_url(f"{scheme}://u:pw@h:5/db").drivername == "postgresql+psycopg"
    assert "pw" not in display_url(f"{scheme}://u:pw@h:5/db")


def test_sqlite_connections_are_durable_and_enforce_foreign_keys(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'new' / 'folder' / 'a.sqlite3'}")  # the folder is created
    with engine.connect() as conn:
        names = ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")
        pragma = {name: conn.exec_driver_sql(f"PRAGMA {name}").scalar() for name in names}
    engine.dispose()
    assert pragma == {"journal_mode": "wal", "synchronous": 2, "foreign_keys": 1, "busy_timeout": 30_000}


def test_sqlite_write_transactions_take_the_write_lock_up_front(tmp_path):
    path = tmp_path / "a.sqlite3"
    engine = make_engine(f"sqlite:///{path}")
    with write_transaction(engine) as conn:
        conn.exec_driver_sql("SELECT 1")  # no write yet, but BEGIN IMMEDIATE already holds the lock
        other = sqlite3.connect(path, timeout=0.05, isolation_level=None)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("BEGIN IMMEDIATE")
        other.close()
    engine.dispose()


def test_ddl_is_transactional_on_sqlite(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'a.sqlite3'}")
    with pytest.raises(RuntimeError), engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (x INTEGER)")
        raise RuntimeError("roll back")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM sqlite_master WHERE name = 't'").scalar() == 0
    engine.dispose()


def test_other_databases_are_refused_with_the_supported_ones_named():
    with pytest.raises(ConfigError, match="SQLite .* or PostgreSQL"):
        make_engine("mysql://u@h/db")
