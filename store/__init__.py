"""The audit store: schema, append-only guards and the AuditWriter's persistence (the hashes it writes: loraledger.digests)."""

from loraledger.store.audit_store import AuditStore
from loraledger.store.db import default_audit_url, make_engine
from loraledger.store.guards import guards_present
from loraledger.store.migrate import current_revision, ensure_schema, head_revision, upgrade
from loraledger.store.records import (
    AdapterRecord,
    AuditBatch,
    Checkpoint,
    CompletionRecord,
    EventKind,
    EventRecord,
    RequestRecord,
)

__all__ = [
    "AdapterRecord",
    "AuditBatch",
    "AuditStore",
    "Checkpoint",
    "CompletionRecord",
    "EventKind",
    "EventRecord",
    "RequestRecord",
    "current_revision",
    "default_audit_url",
    "ensure_schema",
    "guards_present",
    "head_revision",
    "make_engine",
    "upgrade",
]
