"""append-only guards: triggers refusing UPDATE / DELETE / TRUNCATE / REPLACE and mismatched completions

Revision ID: 0002_guards
Revises: 0001_initial
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from loraledger.errors import AuditSchemaError
from loraledger.store import guards

revision: str = "0002_guards"
down_revision: str | Sequence[str] | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # the tables this revision's schema has (a later revision guards the tables it adds)
    guards.install(op.execute, op.get_context().dialect.name, tables=("adapters", "requests", "completions", "events"))


def downgrade() -> None:
    # taking the guards away is exactly what they exist to prevent
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
