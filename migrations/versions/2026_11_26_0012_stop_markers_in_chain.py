"""clean stops in the hash chain: an instance_stopped event for every clean-stop lease marker written before this revision

Revision ID: 0012_stop_markers_in_chain
Revises: 0011_receipts_and_checkpoints
Create Date: 2026-11-26

From this revision on a clean stop appends an instance_stopped event in the transaction that marks its
lease "stopped", and `loraledger audit verify` holds every marker to its event (an erased or forged
marker hides or invents unfinished work). This revision brings the clean stops already on record into
the chain the same way: one event each, appended after the current head (oldest stop first, payload
marked `backfilled_by`, the event's time the migration's), so the chain as it was stays intact. The
markers themselves are not changed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from alembic import op

from loraledger.errors import AuditSchemaError
from loraledger.store.audit_store import append_events
from loraledger.store.instances import backfilled_stop_event, unvouched_stop_markers
from loraledger.store.models import Event

revision: str = "0012_stop_markers_in_chain"
down_revision: str | Sequence[str] | None = "0011_receipts_and_checkpoints"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_context().as_sql:
        raise AuditSchemaError(
            f"revision {revision} computes hash-chain events from the rows on record: it cannot be written out as "
            "an SQL script; run `loraledger db upgrade --url URL` against the database"
        )
    conn = op.get_bind()
    now = time.time()
    for instance_id in unvouched_stop_markers(conn, Event.__table__):
        append_events(conn, [backfilled_stop_event(instance_id, now, revision)], instance_id)


def downgrade() -> None:
    # the audit log is append-only: no revision takes events back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
