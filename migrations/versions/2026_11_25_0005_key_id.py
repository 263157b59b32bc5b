"""the caller's API key in the binding: requests.key_id (and the access_denied event, which needs no schema)

Revision ID: 0005_key_id
Revises: 0004_adapters_in_chain
Create Date: 2026-11-25

`loraledger serve` authenticates every caller with an API key from its keys file; the key gives
the binding's `tenant` and, from this revision on, its `key_id` (the key's id in that file, never
the key or its hash). The column is NULL for every row already on record and for requests
submitted in-process: those bindings verify as before, because `verify` compares a row with the
binding its request_admitted event carries key by key, and an absent key reads as NULL. A new
binding carries `key_id` in that event, so the column is covered by the hash chain like the others.

A refused request (a key asking for a model it may not use) is an `access_denied` event with no
request id: it lives in `events` and its hash chain, so nothing else changes here.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from loraledger.errors import AuditSchemaError

revision: str = "0005_key_id"
down_revision: str | Sequence[str] | None = "0004_adapters_in_chain"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # a plain ADD COLUMN on both dialects (not a batch rebuild: that would drop SQLite's guard triggers)
    op.add_column("requests", sa.Column("key_id", sa.Text(), nullable=True))


def downgrade() -> None:
    # the audit log is append-only: no revision takes columns (or what they hold) back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
