"""signed evidence kept with the log: the receipts and checkpoints tables, guarded

Revision ID: 0011_receipts_and_checkpoints
Revises: 0010_merkle_tree
Create Date: 2026-11-26

`receipts` keeps the signed receipt the engine hands each finished request's caller (written in the
transaction that records the request_finished event, so no receipt exists for an output that is not
on record); `checkpoints` keeps the checkpoints the log signed, which witnesses cosign. Both are
append-only like every audit table, and `loraledger audit verify` checks each row against the chain
and the tree (EVIDENCE.md). Requests finished before this revision have no receipt.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from loraledger.errors import AuditSchemaError
from loraledger.store import guards

revision: str = "0011_receipts_and_checkpoints"
down_revision: str | Sequence[str] | None = "0010_merkle_tree"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("tree_size", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("log_key", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("tree_size", name=op.f("pk_checkpoints")),
    )
    op.create_table(
        "receipts",
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("signature", sa.Text(), nullable=False),
        sa.Column("log_key", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_receipts")),
    )
    guards.install(op.execute, op.get_context().dialect.name, tables=("checkpoints", "receipts"))


def downgrade() -> None:
    # the audit log is append-only: no revision takes tables (or what they hold) back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
