"""request identity: requests.caller_request_id (the caller's id beside the engine's audit key) and requests.chat_template_sha256

Revision ID: 0006_request_identity
Revises: 0005_key_id
Create Date: 2026-11-26

From this revision on `requests.request_id` is a key the engine makes (a UUIDv7: unique across engines and
restarts, ordered by time) and the caller's own request id, which vLLM lets a caller reuse once its earlier
request has finished, is kept beside it in `caller_request_id`. A chat request's binding also records the
sha256 of the chat template that rendered its prompt (`chat_template_sha256`).

Both columns are NULL on every row already on record: those requests were keyed by the caller's id, so their
`request_id` is both their audit key and their caller id (`loraledger audit show` finds them by it), and they
made no template digest. Those bindings verify as before, because `verify` compares a row with the binding its
request_admitted event carries key by key, and an absent key reads as NULL. A new binding carries both keys in
that event, so both columns are under the hash chain like the others. No row is rewritten.

The request_lineage view (revision 0003) gains `caller_request_id` beside `request_id`: the caller's id, or for a
row from before this revision its `request_id`, so `WHERE caller_request_id = 'job-17'` finds every request a
caller sent under that id. The view is dropped and created again (a column cannot be inserted into a view).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from loraledger.errors import AuditSchemaError

revision: str = "0006_request_identity"
down_revision: str | Sequence[str] | None = "0005_key_id"
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
    c.text AS text
FROM requests r
LEFT JOIN adapters a ON a.fingerprint = r.adapter_fingerprint
LEFT JOIN completions c ON c.request_id = r.request_id
"""


def upgrade() -> None:
    # plain ADD COLUMNs on both dialects (not a batch rebuild: that would drop SQLite's guard triggers)
    op.add_column("requests", sa.Column("caller_request_id", sa.Text(), nullable=True))
    op.add_column("requests", sa.Column("chat_template_sha256", sa.String(64), nullable=True))
    # `audit show CALLER-ID` lists every request that used a caller id
    op.create_index("ix_requests__caller_request_id", "requests", ["caller_request_id"])
    op.execute("DROP VIEW request_lineage")
    op.execute(REQUEST_LINEAGE)


def downgrade() -> None:
    # the audit log is append-only: no revision takes columns (or what they hold) back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
