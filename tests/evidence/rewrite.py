"""Rewriting the log's tail as an owner of the database can: guards dropped, every hash and tree node recomputed."""

from __future__ import annotations

from sqlalchemy import delete, select

from loraledger.evidence.node_store import NODES
from loraledger.evidence.receipt_store import RECEIPTS
from loraledger.store.audit_store import EVENTS, write_batch
from loraledger.store.db import make_engine, write_transaction
from loraledger.store.guards import guards_for
from loraledger.store.records import AuditBatch


def rewrite_tail(url: str, keep: int, batch: AuditBatch) -> None:
    """Delete every event past seq keep (and the tree nodes and receipts over them), then append batch as the
    engine would: the chain and the tree are whole again, only different from what was signed before."""
    engine = make_engine(url)
    try:
        with write_transaction(engine) as conn:
            for guard in guards_for(conn.dialect.name):
                on = f" ON {guard.table}" if conn.dialect.name == "postgresql" else ""
                conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {guard.name}{on}")
            conn.execute(delete(EVENTS).where(EVENTS.c.seq > keep))
            conn.execute(delete(RECEIPTS).where(RECEIPTS.c.seq > keep))
            for level, idx in conn.execute(select(NODES.c.level, NODES.c.idx)).all():
                if (idx + 1) << level > keep:
                    conn.execute(delete(NODES).where(NODES.c.level == level, NODES.c.idx == idx))
            write_batch(conn, batch)
    finally:
        engine.dispose()
