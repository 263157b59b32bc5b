"""Tampering helpers for the audit tests: change the log the way an intruder with database access would."""

from __future__ import annotations

from sqlalchemy import text

from loraledger.store.db import make_engine
from loraledger.store.guards import guards_for


def tamper(url: str, *statements: str, **params: object) -> None:
    """Run statements on a raw connection after dropping every append-only guard, as an intruder would."""
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            for guard in guards_for(conn.dialect.name):
                on = f" ON {guard.table}" if conn.dialect.name == "postgresql" else ""
                conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {guard.name}{on}")
            for statement in statements:
                conn.execute(text(statement), params)
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
            for guard in guards_for(conn.dialect.name):
                on = f" ON {guard.table}" if conn.dialect.name == "postgresql" else ""
                conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {guard.name}{on}")
            for table in ("merkle_nodes", "receipts", "checkpoints"):
                conn.exec_driver_sql(f"DELETE FROM {table}")
            backfill(conn)
    finally:
        engine.dispose()
