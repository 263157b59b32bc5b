"""structured outputs in the binding: requests.constraint_kind, constraint_sha256, constraint_text

Revision ID: 0008_structured_outputs
Revises: 0007_instances
Create Date: 2026-11-26

A request constrained by `SamplingParams.structured_outputs` (a JSON schema, regex, choice list,
grammar or json_object) is bound to its constraint: its kind, the sha256 of its canonical JSON text,
and, where prompts are audited as text, that text. The columns are NULL for every row already on
record and for unconstrained requests: those bindings verify as before, because `verify` compares
a row with the binding its request_admitted event carries key by key, and an absent key reads as
NULL. A new binding carries the three keys in that event, so they are under the hash chain.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from loraledger.errors import AuditSchemaError

revision: str = "0008_structured_outputs"
down_revision: str | Sequence[str] | None = "0007_instances"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # plain ADD COLUMNs on both dialects (not a batch rebuild: that would drop SQLite's guard triggers)
    op.add_column("requests", sa.Column("constraint_kind", sa.Text(), nullable=True))
    op.add_column("requests", sa.Column("constraint_sha256", sa.String(64), nullable=True))
    op.add_column("requests", sa.Column("constraint_text", sa.Text(), nullable=True))


def downgrade() -> None:
    # the audit log is append-only: no revision takes columns (or what they hold) back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
