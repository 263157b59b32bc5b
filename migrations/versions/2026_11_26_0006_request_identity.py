"""request identity: requests.caller_request_id (the caller's id beside the engine's audit key) and requests.chat_template_sha256

Revision ID: 0006_request_identity
Revises: 0005_key_id
Create Date: 2026-11-26

From this revision on `requests.request_id` is a key the engine makes (a UUIDv7: unique across engines and
restarts, ordered by time) and the caller's own request id, which vLLM lets a caller reuse once its earlier
request has finished, is kept beside it in `caller_request_id`. A chat request's binding also records the
sha256 of the chat template that rendered its prompt (`chat_template_sha256`).

Both columns are NULL on every row already on record: those requests were keyed by the caller's id, so their
`request_id` is both their audit key and their caller id (`loraledger audit show` finds them by it), and they
made no template digest. Those bindings verify as before, because `verify` compares a row with the binding its
request_admitted event carries key by key, and an absent key reads as NULL. A new binding carries both keys in
that event, so both columns are under the hash chain like the others. No row is rewritten.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from loraledger.errors import AuditSchemaError

revision: str = "0006_request_identity"
down_revision: str | Sequence[str] | None = "0005_key_id"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # plain ADD COLUMNs on both dialects (not a batch rebuild: that would drop SQLite's guard triggers)
    op.add_column("requests", sa.Column("caller_request_id", sa.Text(), nullable=True))
    op.add_column("requests", sa.Column("chat_template_sha256", sa.String(64), nullable=True))
    # `audit show CALLER-ID` lists every request that used a caller id
    op.create_index("ix_requests__caller_request_id", "requests", ["caller_request_id"])


def downgrade() -> None:
    # the audit log is append-only: no revision takes columns (or what they hold) back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
