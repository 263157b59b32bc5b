"""many engines, one audit log: the instances table and its leases, and the instance id on requests and events

Revision ID: 0007_instances
Revises: 0006_request_identity
Create Date: 2026-11-26

Several engines may write one audit database. Each registers at start as an instance (a row in
`instances`, append-only and guarded, vouched for by an instance_registered event on the chain) and
renews a lease in `instance_leases` (coordination state that changes in place, so no guard and no
hash: what it decides, which instance recovered which, goes on the chain as engine_recovered).
`requests.instance_id` and `events.instance_id` name the instance that wrote a row. They are NULL for
every row already on record, which verifies as before: an event's hash covers instance_id only when
it is set, and a requests row's instance_id must equal the one of its request_admitted event.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from loraledger.errors import AuditSchemaError
from loraledger.store import guards

revision: str = "0007_instances"
down_revision: str | Sequence[str] | None = "0006_request_identity"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UTC_TIME = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "instances",
        sa.Column("instance_id", sa.Text(), nullable=False),
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("engine_version", sa.Text(), nullable=False),
        sa.Column("started_at", UTC_TIME, nullable=False),
        sa.Column("lease_seconds", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("instance_id", name=op.f("pk_instances")),
    )
    op.create_table(
        "instance_leases",
        sa.Column("instance_id", sa.Text(), nullable=False),
        sa.Column("expires_at", UTC_TIME, nullable=False),
        sa.Column("process_key", sa.Text(), nullable=True),
        sa.Column("recovered_by", sa.Text(), nullable=True),
        sa.Column("recovered_at", UTC_TIME, nullable=True),
        sa.ForeignKeyConstraint(
            ["instance_id"], ["instances.instance_id"], name=op.f("fk_instance_leases__instance_id__instances")
        ),
        sa.PrimaryKeyConstraint("instance_id", name=op.f("pk_instance_leases")),
    )
    # plain ADD COLUMNs on both dialects (not a batch rebuild: that would drop SQLite's guard triggers)
    op.add_column("requests", sa.Column("instance_id", sa.Text(), nullable=True))
    op.add_column("events", sa.Column("instance_id", sa.Text(), nullable=True))
    op.create_index(op.f("ix_requests__instance_id_received_at"), "requests", ["instance_id", "received_at"])
    guards.install(op.execute, op.get_context().dialect.name, tables=("instances",))


def downgrade() -> None:
    # the audit log is append-only: no revision takes tables, columns (or what they hold) back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
