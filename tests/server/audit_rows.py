"""Reading a server's audit database in the tests."""

from __future__ import annotations

from sqlalchemy import select

from loraledger.audit.queries import completion_column
from loraledger.store.audit_store import COMPLETIONS, EVENTS, REQUESTS
from loraledger.store.db import make_engine


def query(url: str, statement):
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(statement).all()
    finally:
        engine.dispose()


def binding(url: str, request_id: str):
    rows = query(url, select(REQUESTS).where(REQUESTS.c.request_id == request_id))
    return rows[0] if rows else None


def completions_with_text():
    """The `completions` rows with each one's text as the audit listings read it (queries.completion_column): from its
    salted text row in `request_texts` (rows written since salted text), else the row's own `text` (older rows)."""
    columns = [c for c in COMPLETIONS.c if c.name != "text"]
    return select(*columns, completion_column("text").label("text"))


def completions(url: str, request_id: str):
    return query(
        url,
        completions_with_text().where(COMPLETIONS.c.request_id == request_id).order_by(COMPLETIONS.c.completion_index),
    )


def events(url: str, kind: str | None = None, request_id: str | None = None):
    stmt = select(EVENTS).order_by(EVENTS.c.seq)
    if kind is not None:
        stmt = stmt.where(EVENTS.c.kind == kind)
    if request_id is not None:
        stmt = stmt.where(EVENTS.c.request_id == request_id)
    return query(url, stmt)
