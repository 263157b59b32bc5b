"""The audit store: schema, append-only guards and the AuditWriter's persistence (the hashes it writes: loraledger.digests).

The names below are imported on first use: the records (msgspec structs the actors' messages carry) are needed by
every engine, SQLAlchemy and alembic only by an engine that writes an audit log (not with audit_url=None).
"""

from __future__ import annotations

import importlib

# public name -> module
_EXPORTS = {
    "AuditStore": "loraledger.store.audit_store",
    "default_audit_url": "loraledger.store.db",
    "make_engine": "loraledger.store.db",
    "guards_present": "loraledger.store.guards",
    "current_revision": "loraledger.store.migrate",
    "ensure_schema": "loraledger.store.migrate",
    "head_revision": "loraledger.store.migrate",
    "upgrade": "loraledger.store.migrate",
    "AdapterRecord": "loraledger.store.records",
    "AuditBatch": "loraledger.store.records",
    "Checkpoint": "loraledger.store.records",
    "CompletionRecord": "loraledger.store.records",
    "EventKind": "loraledger.store.records",
    "EventRecord": "loraledger.store.records",
    "RequestRecord": "loraledger.store.records",
}

__all__ = [*_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'loraledger.store' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
