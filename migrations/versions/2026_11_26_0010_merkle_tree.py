"""a Merkle tree over the events: the merkle_nodes table, guarded, built over every event on record

Revision ID: 0010_merkle_tree
Revises: 0008_structured_outputs
Create Date: 2026-11-26

From this revision on, the transaction that appends events also appends their leaves to an RFC 9162
Merkle tree (leaf i is the event with seq i + 1) and stores every complete subtree, so the log can sign
checkpoints (tree size, root hash) and serve inclusion and consistency proofs (EVIDENCE.md). This
revision builds the tree over the events already on record; the chain itself does not change.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from loraledger.errors import AuditSchemaError
from loraledger.evidence.node_store import backfill
from loraledger.store import guards

revision: str = "0010_merkle_tree"
down_revision: str | Sequence[str] | None = "0009_hub_sources"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "merkle_nodes",
        sa.Column("level", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("idx", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("level", "idx", name=op.f("pk_merkle_nodes")),
    )
    guards.install(op.execute, op.get_context().dialect.name, tables=("merkle_nodes",))
    if op.get_context().as_sql:
        raise AuditSchemaError(
            f"revision {revision} computes the Merkle tree from the events on record: it cannot be written out as "
            "an SQL script; run `loraledger db upgrade --url URL` against the database"
        )
    backfill(op.get_bind())


def downgrade() -> None:
    # the audit log is append-only: no revision takes tables (or what they hold) back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
