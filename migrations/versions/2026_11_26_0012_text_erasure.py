"""text kept apart so it can be erased: request_texts and erasures, salted commitments in requests and completions

Revision ID: 0012_text_erasure
Revises: 0011_receipts_and_checkpoints
Create Date: 2026-11-26

From this revision on, the engine keeps a prompt's text (where prompts are audited as text) and every
completion's text and token ids in `request_texts`, each row under its own random salt, and the
binding and completions rows commit to them with sha256(salt || text) (DIGESTS.md section 4). `audit
erase` deletes `request_texts` rows, and only it can: the guard lets a row go only when its request has
an `erasures` row naming an `erased` event, which erase appends in the same transaction. Rows written
before this revision keep their text where it is and verify as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from loraledger.errors import AuditSchemaError
from loraledger.store import guards

revision: str = "0012_text_erasure"
down_revision: str | Sequence[str] | None = "0011_receipts_and_checkpoints"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for table, columns in (("requests", ("prompt_commitment", "prompt_token_ids_commitment")),
                           ("completions", ("text_commitment", "token_ids_commitment"))):  # fmt: skip
        for name in columns:
            op.add_column(table, sa.Column(name, sa.String(64), nullable=True))
    op.create_table(
        "request_texts",
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("part", sa.Text(), nullable=False),
        sa.Column("idx", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("salt", sa.Text(), nullable=False),
        sa.Column("text", sa.Text(), nullable=True),
        sa.Column("token_ids", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("request_id", "part", "idx", name=op.f("pk_request_texts")),
    )
    op.create_table(
        "erasures",
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_erasures")),
    )
    op.create_index(op.f("ix_erasures__seq"), "erasures", ["seq"])
    guards.install(op.execute, op.get_context().dialect.name, tables=("request_texts", "erasures"))


def downgrade() -> None:
    # the audit log is append-only: no revision takes tables (or what they hold) back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
