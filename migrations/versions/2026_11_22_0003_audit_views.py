"""audit views: adapter_usage (per adapter and UTC day) and request_lineage (request -> binding -> adapter -> completions)

Revision ID: 0003_audit_views
Revises: 0002_guards
Create Date: 2026-11-22

The views are for people querying the log with SQL; loraledger's own queries read the tables.
The same SQL runs on both dialects except for the UTC day, which is text 'YYYY-MM-DD' on both.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from loraledger.errors import AuditSchemaError

revision: str = "0003_audit_views"
down_revision: str | Sequence[str] | None = "0002_guards"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UTC_DAY = {
    # SQLite keeps times as UTC text 'YYYY-MM-DD HH:MM:SS.ffffff+00:00'
    "sqlite": "substr(r.received_at, 1, 10)",
    "postgresql": "to_char(r.received_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
}

# A request's last lifecycle event names its outcome (request_resumed: it was running again).
LIFECYCLE = "'request_finished', 'request_aborted', 'request_failed', 'request_interrupted', 'request_resumed'"

ADAPTER_USAGE = """
CREATE VIEW adapter_usage AS
SELECT
    r.adapter_fingerprint AS adapter_fingerprint,
    a.name AS adapter_name,
    {day} AS day,
    count(*) AS requests,
    CAST(sum(coalesce(g.completions, 0)) AS BIGINT) AS completions,
    CAST(sum(r.prompt_token_count) AS BIGINT) AS prompt_tokens,
    CAST(sum(coalesce(g.generated_tokens, 0)) AS BIGINT) AS generated_tokens,
    CAST(sum(CASE WHEN f.request_id IS NULL THEN 0 ELSE 1 END) AS BIGINT) AS errors
FROM requests r
LEFT JOIN adapters a ON a.fingerprint = r.adapter_fingerprint
LEFT JOIN (
    SELECT request_id, count(*) AS completions, sum(generated_token_count) AS generated_tokens
    FROM completions GROUP BY request_id
) g ON g.request_id = r.request_id
LEFT JOIN (
    SELECT DISTINCT request_id FROM events WHERE kind = 'request_failed'
) f ON f.request_id = r.request_id
GROUP BY r.adapter_fingerprint, a.name, {day}
"""

REQUEST_LINEAGE = f"""
CREATE VIEW request_lineage AS
SELECT
    r.request_id AS request_id,
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
    c.text AS text
FROM requests r
LEFT JOIN adapters a ON a.fingerprint = r.adapter_fingerprint
LEFT JOIN completions c ON c.request_id = r.request_id
"""


def upgrade() -> None:
    dialect = op.get_context().dialect.name
    if dialect not in UTC_DAY:
        raise AuditSchemaError(f"the audit views support SQLite and PostgreSQL, not {dialect!r}")
    op.execute(ADAPTER_USAGE.format(day=UTC_DAY[dialect]))
    op.execute(REQUEST_LINEAGE)


def downgrade() -> None:
    # the audit log is append-only: no revision takes the schema (or its guards) back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
