"""how the base model's weights are quantized as served: quantization columns on instances

Revision ID: 0015_base_quantization
Revises: 0014_tool_calls
Create Date: 2026-11-26

An engine may serve a quantized base model (a GPTQ, AWQ, compressed-tensors or bitsandbytes checkpoint, or a GGUF
file). `instances` gains `quantization` (a readable description, "gptq 4-bit g128 asym"), `quant_method`,
`quant_bits` and `quant_group_size` (NULL: one scale per output channel), and `quant_source_fingerprint` (a float
checkpoint quantized at load: its own base-model fingerprint, beside the requests' fingerprint of what was served),
all NULL for float weights and for rows
already on record, which verify as before (a key absent from an old instance_registered event reads as NULL). New
rows carry them in their events, under the chain. Every request names its instance, so the request's record names
the quantization that answered it; the base-model fingerprint covers the quantized tensors and config as loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from loraledger.errors import AuditSchemaError

revision: str = "0015_base_quantization"
down_revision: str | Sequence[str] | None = "0014_tool_calls"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # plain ADD COLUMNs on both dialects (not a batch rebuild: that would drop SQLite's guard triggers)
    op.add_column("instances", sa.Column("quantization", sa.Text(), nullable=True))
    op.add_column("instances", sa.Column("quant_method", sa.Text(), nullable=True))
    op.add_column("instances", sa.Column("quant_bits", sa.Integer(), nullable=True))
    op.add_column("instances", sa.Column("quant_group_size", sa.Integer(), nullable=True))
    op.add_column("instances", sa.Column("quant_source_fingerprint", sa.String(64), nullable=True))


def downgrade() -> None:
    # the audit log is append-only: no revision takes columns (or what they hold) back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
