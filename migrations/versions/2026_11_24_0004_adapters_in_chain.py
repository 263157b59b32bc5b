"""adapters in the hash chain: an adapter_registered event for every `adapters` row written before this revision

Revision ID: 0004_adapters_in_chain
Revises: 0003_audit_views
Create Date: 2026-11-24

From this revision on the store appends an adapter_registered event (its payload: the whole row)
in the transaction that inserts an `adapters` row, and `loraledger audit verify` checks every row
against its event. This revision brings the rows already on record into the chain the same way:
one event each, appended after the current head (oldest row first, payload marked
`backfilled_by`), so the chain as it was stays intact and verifiable. Nothing else changes.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from loraledger.errors import AuditSchemaError
from loraledger.store.audit_store import backfill_registrations

revision: str = "0004_adapters_in_chain"
down_revision: str | Sequence[str] | None = "0003_audit_views"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_context().as_sql:
        raise AuditSchemaError(
            f"revision {revision} computes hash-chain events from the rows on record: it cannot be written out as "
            "an SQL script; run `loraledger db upgrade --url URL` against the database"
        )
    backfill_registrations(op.get_bind(), revision)


def downgrade() -> None:
    # the audit log is append-only: no revision takes events back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
