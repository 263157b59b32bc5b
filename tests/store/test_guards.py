"""The append-only guards: the database itself refuses to change, remove or replace audit rows."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Engine, insert, inspect, select
from sqlalchemy import exc as sa_exc

from loraledger.audit.erase import erase
from loraledger.evidence import log_tree
from loraledger.evidence.log_key import LogKey
from loraledger.store.audit_store import COMPLETIONS, AuditStore
from loraledger.store.db import make_engine, write_transaction
from loraledger.store.guards import PG_FUNCTIONS, guards_present
from loraledger.store.instances import this_instance
from loraledger.store.models import AUDIT_TABLES
from loraledger.store.rows import completion_row
from tests.audit.salted import write_salted
from tests.db_fixtures import FP_A, FP_B, T0, make_completion, sample_batch

# a column per table that an attacker would like to rewrite
TARGET = {
    "adapters": "name",
    "requests": "tenant",
    "completions": "text",
    "events": "kind",
    "instances": "host",
    "merkle_nodes": "hash",
    "checkpoints": "note",
    "receipts": "body",
    "request_texts": "text",
    "erasures": "request_id",
}
KEY = {
    "instances": "instance_id",
    "adapters": "fingerprint",
    "requests": "request_id",
    "completions": "request_id, completion_index",
    "events": "seq",
    "merkle_nodes": "level, idx",
    "checkpoints": "tree_size",
    "receipts": "request_id",
    "request_texts": "request_id, part, idx",
    "erasures": "request_id",
}


@pytest.fixture
def engine(audit_store: AuditStore) -> Iterator[Engine]:
    audit_store.register(this_instance("test", lease_seconds=60))
    audit_store.log_key = LogKey(
        Ed25519PrivateKey.generate(), "test.example/log"
    )  # receipts, a checkpoint: rows to guard
    audit_store.write(sample_batch(["r1", "r2"]))
    audit_store.write(sample_batch(["base1"], None))
    write_salted(audit_store, ["s1", "s2"], at=T0 + 10, tenant="acme")  # text rows, one of them erased
    with write_transaction(audit_store.engine) as conn:
        erase(conn, request_id="s1", reason="asked")
    engine = make_engine(audit_store.url)
    with engine.begin() as conn:
        log_tree.sign_checkpoint(conn, audit_store.log_key)
    yield engine
    engine.dispose()


def dump(engine: Engine) -> str:
    """Every audit row, byte for byte (on PostgreSQL with its physical location and writing transaction)."""
    if engine.dialect.name == "sqlite":
        raw = sqlite3.connect(engine.url.database)
        try:
            return "\n".join(raw.iterdump())
        finally:
            raw.close()
    with engine.connect() as conn:
        return "\n".join(
            f"{table} {row[0]}"
            for table in AUDIT_TABLES
            for row in conn.exec_driver_sql(
                f"SELECT ctid::text || ' ' || xmin::text || ' ' || t::text FROM {table} t ORDER BY ctid"
            )
        )


def refused(engine: Engine, sql: str, message: str, *, setup: str | None = None) -> None:
    before = dump(engine)
    with pytest.raises(sa_exc.IntegrityError, match=message):
        with engine.begin() as conn:
            if setup:
                conn.exec_driver_sql(setup)
            conn.exec_driver_sql(sql)
    assert dump(engine) == before


def select_with(engine: Engine, table: str, column: str, value: str) -> str:
    """SELECT list copying one row of table, with column replaced by value."""
    names = [c["name"] for c in inspect(engine).get_columns(table)]
    cols = ", ".join(value if name == column else name for name in names)
    return f"SELECT {cols} FROM {table} ORDER BY {KEY[table]} LIMIT 1"


def test_update_and_delete_are_refused(engine):
    for table in AUDIT_TABLES:
        col = TARGET[table]
        refused(engine, f"UPDATE {table} SET {col} = {col}", f"audit table {table} is append-only")
        refused(engine, f"UPDATE {table} SET {col} = 'tampered'", f"audit table {table} is append-only")
        refused(engine, f"DELETE FROM {table}", f"audit table {table} is append-only")


# erasures has no text column outside its key: its replacement rewrites the event it names
REPLACED = {"erasures": ("seq", "seq + 1000")}


def test_replacing_a_row_is_refused(engine):
    for table in AUDIT_TABLES:
        column, value = REPLACED.get(table, (TARGET[table], "'tampered'"))
        source = select_with(engine, table, column, value)
        message = f"audit table {table} is append-only"
        upsert = f"DO UPDATE SET {column} = excluded.{column}"
        if engine.dialect.name == "sqlite":
            refused(engine, f"INSERT OR REPLACE INTO {table} {source}", message)
            refused(engine, f"REPLACE INTO {table} {source}", message)
            where_true = source.replace("ORDER BY", "WHERE true ORDER BY")  # SQLite's upsert-after-SELECT rule
            refused(engine, f"INSERT INTO {table} {where_true} ON CONFLICT {upsert}", message)
            refused(engine, f"INSERT OR IGNORE INTO {table} {source}", message)
        else:
            refused(engine, f"INSERT INTO {table} {source} ON CONFLICT ({KEY[table]}) {upsert}", message)
            refused(engine, f"TRUNCATE {table} CASCADE", message)


def test_replacing_an_event_through_its_dedup_key_is_refused(engine):
    source = select_with(engine, "events", "seq", "999")
    conflict = "OR REPLACE" if engine.dialect.name == "sqlite" else ""
    suffix = "" if engine.dialect.name == "sqlite" else " ON CONFLICT (dedup_key) DO UPDATE SET kind = excluded.kind"
    refused(engine, f"INSERT {conflict} INTO events {source}{suffix}", "audit table events is append-only")


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_replica_mode_does_not_switch_the_guards_off(engine):
    replica = "SET LOCAL session_replication_role = replica"
    for table in AUDIT_TABLES:
        refused(engine, f"UPDATE {table} SET {TARGET[table]} = 'x'", "append-only", setup=replica)
        refused(engine, f"DELETE FROM {table}", "append-only", setup=replica)
        refused(engine, f"TRUNCATE {table} CASCADE", "append-only", setup=replica)


def insert_completion(engine: Engine, request_id: str, fingerprint: str | None, index: int) -> None:
    with engine.begin() as conn:
        conn.execute(insert(COMPLETIONS), [completion_row(make_completion(request_id, fingerprint, index))])


def test_a_completion_bound_to_another_adapter_is_refused(engine):
    before = dump(engine)
    for request_id, fingerprint in [("r1", FP_B), ("r1", None), ("base1", FP_A)]:
        with pytest.raises(sa_exc.IntegrityError, match="adapter_fingerprint"):
            insert_completion(engine, request_id, fingerprint, index=1)
    assert dump(engine) == before


def test_a_completion_matching_its_binding_is_accepted(engine):
    insert_completion(engine, "r1", FP_A, index=1)
    insert_completion(engine, "base1", None, index=1)  # NULL = NULL: the base model
    with engine.connect() as conn:
        query = select(COMPLETIONS.c.completion_index).where(COMPLETIONS.c.request_id == "base1")
        assert conn.execute(query).scalars().all() == [0, 1]


def test_guards_present_names_missing_disabled_and_altered_guards(engine):
    with engine.connect() as conn:
        assert guards_present(conn) == []
    if engine.dialect.name == "sqlite":
        tamper = [
            "DROP TRIGGER events_no_update",
            "DROP TRIGGER requests_no_delete",
            "CREATE TRIGGER requests_no_delete BEFORE DELETE ON requests BEGIN SELECT 1; END",
        ]
        expected = ["requests_no_delete", "events_no_update"]
    else:
        body = PG_FUNCTIONS["loraledger_check_completion_binding"].replace("RAISE EXCEPTION", "RAISE NOTICE")
        tamper = [
            "DROP TRIGGER events_no_update ON events",
            "ALTER TABLE requests ENABLE TRIGGER requests_no_delete",
            "ALTER TABLE adapters DISABLE TRIGGER adapters_no_truncate",
            "DROP TRIGGER completions_no_update ON completions",
            "CREATE TRIGGER completions_no_update AFTER INSERT ON completions FOR EACH ROW "
            "EXECUTE FUNCTION loraledger_refuse_change()",
            "ALTER TABLE completions ENABLE ALWAYS TRIGGER completions_no_update",
            "CREATE OR REPLACE FUNCTION loraledger_check_completion_binding() RETURNS trigger "
            f"LANGUAGE plpgsql AS $${body}$$",
        ]
        expected = [
            "adapters_no_truncate (not ENABLE ALWAYS)",
            "requests_no_delete (not ENABLE ALWAYS)",
            "completions_no_update (re-created with another timing, event or condition)",
            "events_no_update",
            "completions_binding (its function loraledger_check_completion_binding() was altered)",
        ]
    with engine.begin() as conn:
        for sql in tamper:
            conn.exec_driver_sql(sql)
    with engine.connect() as conn:
        assert guards_present(conn) == expected
