"""Where the models and adapters of a report came from: each engine instance's model and tokenizer, each adapter's
Hub repo, the revision asked for and the commit read (NULL-valued for local folders and older rows)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select

from loraledger.audit import queries as q
from loraledger.store.instances import SOURCE_FIELDS
from loraledger.store.records import AdapterRecord


def model_sources(conn: Connection, flt: q.RequestFilter) -> list[dict[str, Any]]:
    """The instances that admitted the filter's requests, each with where its model and tokenizer came from."""
    admitted = select(q.R.c.instance_id).where(*flt.clauses(), q.R.c.instance_id.is_not(None)).distinct()
    columns = [q.I.c.instance_id, *(q.I.c[name] for name in SOURCE_FIELDS)]
    stmt = select(*columns).where(q.I.c.instance_id.in_(admitted)).order_by(q.I.c.started_at, q.I.c.instance_id)
    return [dict(row._mapping) for row in q.stream(conn, stmt)]


def adapter_source(record: AdapterRecord) -> dict[str, Any]:
    return {
        "fingerprint": record.fingerprint,
        "name": record.name,
        "path": record.path,
        "repo_id": record.repo_id,
        "revision": record.revision,
        "commit_sha": record.commit_sha,
    }


def describe(repo_id: str | None, revision: str | None, commit_sha: str | None) -> str | None:
    """One line for people: "org/name @ main -> commit <sha>" (None when nothing is known: a local folder)."""
    if repo_id is None and commit_sha is None:
        return None
    asked = f" @ {revision}" if revision else ""
    return f"{repo_id or '(Hub cache folder)'}{asked}, commit {commit_sha or 'unknown'}"
