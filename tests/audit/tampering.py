"""Tampering helpers for the audit tests: change the log the way an intruder with database access would."""

from __future__ import annotations

from sqlalchemy import Connection, inspect, text

from loraledger.store.db import make_engine
from loraledger.store.guards import guards_for, install


def drop_guards(conn: Connection) -> None:
    """Drop every append-only guard (the caller puts them back, with reinstall_guards, as a careful intruder would)."""
    for guard in guards_for(conn.dialect.name):
        on = f" ON {guard.table}" if conn.dialect.name == "postgresql" else ""
        conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {guard.name}{on}")


def reinstall_guards(conn: Connection) -> None:
    install(conn.exec_driver_sql, conn.dialect.name, tables=inspect(conn).get_table_names())


def tamper(url: str, *statements: str, **params: object) -> None:
    """Run statements on a raw connection after dropping every append-only guard, then put the guards back, as a
    careful intruder would (verify reports a guard missing or altered: tests/audit/test_schema_objects.py)."""
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            drop_guards(conn)
            for statement in statements:
                conn.execute(text(statement), params)
            reinstall_guards(conn)
    finally:
        engine.dispose()


def event_seq(url: str, request_id: str, kind: str) -> int:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(
                text("SELECT seq FROM events WHERE request_id = :r AND kind = :k"), {"r": request_id, "k": kind}
            ).scalar_one()
    finally:
        engine.dispose()


def rebuild_tree(url: str) -> None:
    """Rebuild the Merkle tree (and drop the receipts and signed checkpoints) over the events as they now are,
    as a careful intruder who has rewritten events would: the log is consistent again, only a checkpoint held
    elsewhere can tell."""
    from loraledger.evidence.node_store import backfill

    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            drop_guards(conn)
            for table in ("merkle_nodes", "receipts", "checkpoints"):
                conn.exec_driver_sql(f"DELETE FROM {table}")
            backfill(conn)
            reinstall_guards(conn)
    finally:
        engine.dispose()
