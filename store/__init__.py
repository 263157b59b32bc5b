"""The audit store: schema, append-only guards, hash chain and the AuditWriter's persistence."""

from loraledger.store.audit_store import AuditStore
from loraledger.store.canonical import canonical_json, digest
from loraledger.store.db import default_audit_url, make_engine
from loraledger.store.guards import guards_present
from loraledger.store.hashchain import GENESIS_HASH, event_hash, verify_chain
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
    "GENESIS_HASH",
    "AdapterRecord",
    "AuditBatch",
    "AuditStore",
    "Checkpoint",
    "CompletionRecord",
    "EventKind",
    "EventRecord",
    "RequestRecord",
    "canonical_json",
    "current_revision",
    "default_audit_url",
    "digest",
    "ensure_schema",
    "event_hash",
    "guards_present",
    "head_revision",
    "make_engine",
    "upgrade",
    "verify_chain",
]
