"""where models and adapters came from: Hub repo, revision asked for and commit sha on adapters, requests and instances

Revision ID: 0009_hub_sources
Revises: 0008_structured_outputs
Create Date: 2026-11-26

A model, tokenizer or adapter may be named by a Hugging Face Hub repo id; the revision asked for
(a branch, a tag) moves, the commit it resolved to does not. `adapters` gains `repo_id`, `revision`
and `commit_sha` (where the content first seen came from), `requests` gains `adapter_repo_id`,
`adapter_revision` and `adapter_commit_sha` (where this request's adapter was read from: the same
content may come from several commits), and `instances` gains `model` and `tokenizer` (as given)
with the repo, revision and commit of each. Every column is NULL for rows already on record, which
verify as before: `verify` compares each row with the event that vouches for it key by key, and a
key absent from an old event reads as NULL. New rows carry them in their events, under the chain.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from loraledger.errors import AuditSchemaError

revision: str = "0009_hub_sources"
down_revision: str | Sequence[str] | None = "0008_structured_outputs"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SOURCE = (("repo_id", sa.Text()), ("revision", sa.Text()), ("commit_sha", sa.String(40)))


def upgrade() -> None:
    # plain ADD COLUMNs on both dialects (not a batch rebuild: that would drop SQLite's guard triggers)
    for name, type_ in _SOURCE:
        op.add_column("adapters", sa.Column(name, type_, nullable=True))
        op.add_column("requests", sa.Column(f"adapter_{name}", type_, nullable=True))
    for what in ("model", "tokenizer"):
        op.add_column("instances", sa.Column(what, sa.Text(), nullable=True))
        for name, type_ in _SOURCE:
            op.add_column("instances", sa.Column(f"{what}_{name}", type_, nullable=True))


def downgrade() -> None:
    # the audit log is append-only: no revision takes columns (or what they hold) back
    raise AuditSchemaError(f"downgrading the audit schema below {revision} is refused; restore a backup instead")
