"""text kept apart so it can be erased: request_texts and erasures, salted commitments in requests and completions

Revision ID: 0013_text_erasure
Revises: 0012_stop_markers_in_chain
Create Date: 2026-11-26

From this revision on, the engine keeps a prompt's text (where prompts are audited as text) and every
completion's text and token ids in `request_texts`, each row under its own random salt, and the
binding and completions rows commit to them with sha256(salt || text) (DIGESTS.md section 4). `audit
erase` deletes `request_texts` rows, and only it can: the guard lets a row go only when its request has
an `erasures` row naming an `erased` event, which erase appends in the same transaction. Rows written
before this revision keep their text where it is and verify as before.

The request_lineage view's `text` reads a salted completion's text from `request_texts` (NULL once erased, with
`text_erased` 1), and an older row's from `completions` as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from loraledger.errors import AuditSchemaError
from loraledger.store import guards

revision: str = "0013_text_erasure"
down_revision: str | Sequence[str] | None = "0012_stop_markers_in_chain"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# A request's last lifecycle event names its outcome (request_resumed: it was running again), as in 0003.
LIFECYCLE = "'request_finished', 'request_aborted', 'request_failed', 'request_interrupted', 'request_resumed'"

REQUEST_LINEAGE = f"""
CREATE VIEW request_lineage AS
SELECT
    r.request_id AS request_id,
    coalesce(r.caller_request_id, r.request_id) AS caller_request_id,
    r.received_at AS received_at,
    r.tenant AS tenant,
    r.lora_name AS lora_name,
    r.lora_int_id AS lora_int_id,
    r.lora_path AS lora_path,
    r.adapter_fingerprint AS adapter_fingerprint,
    a.name AS adapter_name,
    a.path AS adapter_path,
    a.rank AS adapter_rank,
    a.alpha AS adapter_alpha,
    r.base_model_fingerprint AS base_model_fingerprint,
    r.engine_version AS engine_version,
    r.prompt_sha256 AS prompt_sha256,
    r.prompt_token_count AS prompt_token_count,
    (SELECT e.seq FROM events e
      WHERE e.request_id = r.request_id AND e.kind = 'request_admitted'
      ORDER BY e.seq LIMIT 1) AS admitted_seq,
    (SELECT e.kind FROM events e
      WHERE e.request_id = r.request_id AND e.kind IN ({LIFECYCLE})
      ORDER BY e.seq DESC LIMIT 1) AS last_lifecycle_event,
    c.completion_index AS completion_index,
    c.adapter_fingerprint AS completion_adapter_fingerprint,
    c.finish_reason AS finish_reason,
    c.stop_reason AS stop_reason,
    c.generated_token_count AS generated_token_count,
    c.first_token_at AS first_token_at,
    c.finished_at AS finished_at,
    CASE WHEN c.text_commitment IS NULL THEN c.text ELSE t.text END AS text,
    CASE WHEN c.text_commitment IS NOT NULL AND t.request_id IS NULL THEN 1 ELSE 0 END AS text_erased
FROM requests r
LEFT JOIN adapters a ON a.fingerprint = r.adapter_fingerprint
LEFT JOIN completions c ON c.request_id = r.request_id
LEFT JOIN request_texts t ON t.request_id = c.request_id AND t.part = 'completion' AND t.idx = c.completion_index
"""


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
    op.execute("DROP VIEW request_lineage")
    op.execute(REQUEST_LINEAGE)


def downgrade() -> None:
    # the audit log is append-only: no revision takes tables (or what they hold) back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
