"""caller content apart so it can be erased: tool definitions, constraint text and tool calls under salts

Revision ID: 0016_erasable_caller_content
Revises: 0015_base_quantization
Create Date: 2026-11-27

From this revision on, the tool definitions a request sends, its structured-output constraint's text (both where
prompts are audited as text) and the tool calls read from each completion (with their arguments) live in
`request_texts` (parts "tools", "constraint", "tool_calls"), each row under its own random salt, like the prompt and
completion text since 0013. The binding carries `tools_commitment` / `constraint_commitment` = sha256(salt || text)
(its `tools_text` / `constraint_text` stay NULL) and `tool_reading` (how the calls are read, so a resumed request
reads them as the first run did); a completion carries `tool_calls_commitment` (its `tool_calls` NULL), which its
digest takes in place of the calls (form v3, DIGESTS.md section 4). `audit erase` deletes those rows with the rest.

No data moves: rows written before this revision hold their tool definitions, constraint text and calls inline in
rows the chain covers, which cannot be rewritten without breaking the chain; they keep them and verify as before.

The guard set gains `request_texts_after_erasure`: a text row for a request whose erasure is on record is refused,
so an erased request (say, one interrupted and then resumed) never gets new kept text.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from loraledger.errors import AuditSchemaError
from loraledger.store import guards

revision: str = "0016_erasable_caller_content"
down_revision: str | Sequence[str] | None = "0015_base_quantization"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # plain ADD COLUMNs on both dialects (not a batch rebuild: that would drop SQLite's guard triggers)
    op.add_column("requests", sa.Column("tools_commitment", sa.String(64), nullable=True))
    op.add_column("requests", sa.Column("constraint_commitment", sa.String(64), nullable=True))
    op.add_column("requests", sa.Column("tool_reading", sa.JSON(none_as_null=True), nullable=True))
    op.add_column("completions", sa.Column("tool_calls_commitment", sa.String(64), nullable=True))
    guards.install(op.execute, op.get_context().dialect.name, tables=("request_texts",))


def downgrade() -> None:
    # the audit log is append-only: no revision takes columns (or what they hold) back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
