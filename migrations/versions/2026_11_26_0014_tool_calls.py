"""tool calls on record: requests.tools_sha256, tools_text and completions.tool_calls

Revision ID: 0014_tool_calls
Revises: 0013_text_erasure
Create Date: 2026-11-26

A request with tools (the chat route's or the Responses API's `tools`) is bound to their definitions: the sha256
of their canonical JSON text and, where prompts are audited as text, that text. Each of its completions holds
the calls read from its text (a forced call's constrained JSON, or what the auto parser found), as canonical
JSON; NULL without a call. Rows already on record hold NULL and verify as before: a binding's absent key reads
as NULL, and a completion's digest takes `tool_calls` only when it holds calls (DIGESTS.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from loraledger.errors import AuditSchemaError

revision: str = "0014_tool_calls"
down_revision: str | Sequence[str] | None = "0013_text_erasure"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # plain ADD COLUMNs on both dialects (not a batch rebuild: that would drop SQLite's guard triggers)
    op.add_column("requests", sa.Column("tools_sha256", sa.String(64), nullable=True))
    op.add_column("requests", sa.Column("tools_text", sa.Text(), nullable=True))
    op.add_column("completions", sa.Column("tool_calls", sa.Text(), nullable=True))


def downgrade() -> None:
    # the audit log is append-only: no revision takes columns (or what they hold) back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
