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

The request_lineage view gains `tool_calls`: a completion's calls, read from `request_texts` where they are kept apart
(NULL once erased, when `text_erased` is 1) and from `completions` for older rows.

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
    CASE WHEN c.text_commitment IS NOT NULL AND t.request_id IS NULL THEN 1 ELSE 0 END AS text_erased,
    CASE WHEN c.tool_calls_commitment IS NULL THEN c.tool_calls ELSE k.text END AS tool_calls
FROM requests r
LEFT JOIN adapters a ON a.fingerprint = r.adapter_fingerprint
LEFT JOIN completions c ON c.request_id = r.request_id
LEFT JOIN request_texts t ON t.request_id = c.request_id AND t.part = 'completion' AND t.idx = c.completion_index
LEFT JOIN request_texts k ON k.request_id = c.request_id AND k.part = 'tool_calls' AND k.idx = c.completion_index
"""


def upgrade() -> None:
    # plain ADD COLUMNs on both dialects (not a batch rebuild: that would drop SQLite's guard triggers)
    op.add_column("requests", sa.Column("tools_commitment", sa.String(64), nullable=True))
    op.add_column("requests", sa.Column("constraint_commitment", sa.String(64), nullable=True))
    op.add_column("requests", sa.Column("tool_reading", sa.JSON(none_as_null=True), nullable=True))
    op.add_column("completions", sa.Column("tool_calls_commitment", sa.String(64), nullable=True))
    guards.install(op.execute, op.get_context().dialect.name, tables=("request_texts",))
    op.execute("DROP VIEW request_lineage")
    op.execute(REQUEST_LINEAGE)


def downgrade() -> None:
    # the audit log is append-only: no revision takes columns (or what they hold) back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
