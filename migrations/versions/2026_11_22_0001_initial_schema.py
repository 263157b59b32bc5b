"""initial schema: adapters, requests, completions, events

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from loraledger.errors import AuditSchemaError

revision: str = "0001_initial"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UTC_TIME = sa.DateTime(timezone=True)
SHA256 = sa.String(64)


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("fingerprint", SHA256, nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("int_id", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Double(), nullable=False),
        sa.Column("target_modules", sa.JSON(), nullable=False),
        sa.Column("base_model_fingerprint", SHA256, nullable=False),
        sa.Column("use_rslora", sa.Boolean(), nullable=False),
        sa.Column("first_seen", UTC_TIME, nullable=False),
        sa.PrimaryKeyConstraint("fingerprint", name=op.f("pk_adapters")),
    )
    op.create_table(
        "requests",
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("adapter_fingerprint", SHA256, nullable=True),
        sa.Column("lora_name", sa.Text(), nullable=True),
        sa.Column("lora_int_id", sa.Integer(), nullable=True),
        sa.Column("lora_path", sa.Text(), nullable=True),
        sa.Column("tenant", sa.Text(), nullable=True),
        sa.Column("sampling_params", sa.JSON(), nullable=False),
        sa.Column("prompt_text", sa.Text(), nullable=True),
        sa.Column("prompt_sha256", SHA256, nullable=True),
        sa.Column("prompt_token_count", sa.Integer(), nullable=False),
        sa.Column("received_at", UTC_TIME, nullable=False),
        sa.Column("engine_version", sa.Text(), nullable=False),
        sa.Column("base_model_fingerprint", SHA256, nullable=False),
        sa.ForeignKeyConstraint(
            ["adapter_fingerprint"],
            ["adapters.fingerprint"],
            name=op.f("fk_requests__adapter_fingerprint__adapters"),
        ),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_requests")),
    )
    op.create_index(
        op.f("ix_requests__adapter_fingerprint_received_at"), "requests", ["adapter_fingerprint", "received_at"]
    )
    op.create_index(op.f("ix_requests__tenant_received_at"), "requests", ["tenant", "received_at"])
    op.create_index(op.f("ix_requests__received_at"), "requests", ["received_at"])
    op.create_table(
        "completions",
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("completion_index", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("token_ids", sa.JSON(), nullable=False),
        sa.Column("cumulative_logprob", sa.Double(), nullable=True),
        sa.Column("finish_reason", sa.Text(), nullable=False),
        sa.Column("stop_reason", sa.Text(), nullable=True),
        sa.Column("adapter_fingerprint", SHA256, nullable=True),
        sa.Column("prompt_token_count", sa.Integer(), nullable=False),
        sa.Column("generated_token_count", sa.Integer(), nullable=False),
        sa.Column("first_token_at", UTC_TIME, nullable=True),
        sa.Column("finished_at", UTC_TIME, nullable=False),
        sa.ForeignKeyConstraint(
            ["request_id"],
            ["requests.request_id"],
            name=op.f("fk_completions__request_id__requests"),
        ),
        sa.PrimaryKeyConstraint("request_id", "completion_index", name=op.f("pk_completions")),
    )
    op.create_index(op.f("ix_completions__finish_reason"), "completions", ["finish_reason"])
    op.create_index(op.f("ix_completions__adapter_fingerprint"), "completions", ["adapter_fingerprint"])
    op.create_table(
        "events",
        sa.Column("seq", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("at", UTC_TIME, nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("request_id", sa.Text(), nullable=True),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("dedup_key", sa.Text(), nullable=True),
        sa.Column("prev_hash", SHA256, nullable=False),
        sa.Column("hash", SHA256, nullable=False),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_events")),
        sa.UniqueConstraint("dedup_key", name=op.f("uq_events__dedup_key")),
    )
    op.create_index(op.f("ix_events__request_id_kind"), "events", ["request_id", "kind"])
    op.create_index(op.f("ix_events__kind"), "events", ["kind"])


def downgrade() -> None:
    # dropping the tables would destroy the audit log: refused, as every downgrade is
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
