"""Salted text kept apart from the chain (`request_texts`): made by the engine, written with its batch, read back.

A prompt kept as text and every completion's text and token ids go into `request_texts`, each under a fresh salt,
while the binding and the completions row carry only sha256(salt || text) and sha256(salt || ids)
(loraledger/digests.py). The chain, the Merkle tree and the receipts never hold the text itself, so `audit erase`
can delete these rows and everything on record still verifies. The records themselves are made in
store/records.py (salted_text, text_commitments), which the engine's actors import without SQLAlchemy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, Table, insert, select, tuple_

from loraledger.errors import RequestErasedError
from loraledger.store.models import Erasure, RequestText
from loraledger.store.records import (  # the parts, named here too for the readers of text rows
    COMPLETION,  # noqa: F401
    CONSTRAINT,  # noqa: F401
    PROMPT,
    TOOL_CALLS,  # noqa: F401
    TOOLS,  # noqa: F401
    AuditBatch,
    EventKind,
    TextRecord,
)

TEXTS: Table = RequestText.__table__  # type: ignore[assignment]
_IN_CHUNK = 300


def refuse_after_erasure(conn: Connection, batch: AuditBatch) -> None:
    """Refuse (RequestErasedError) a batch that keeps text for, or resumes, a request whose erasure is on record.

    Called under the writers' lock, which `audit erase` also takes: an erasure either committed before (and is seen
    here) or comes after this batch, when the request it resumes has not ended and erase passes it by."""
    ids = {t.request_id for t in batch.texts}
    ids.update(e.request_id for e in batch.events if e.kind == EventKind.REQUEST_RESUMED and e.request_id is not None)
    if not ids:
        return
    x = Erasure.__table__
    found = conn.execute(select(x.c.request_id, x.c.seq).where(x.c.request_id.in_(sorted(ids))).limit(1)).first()
    if found is not None:
        raise RequestErasedError(
            f"request {found.request_id!r} was erased (event {found.seq}): it is not resumed and no new text is kept "
            "for it; submit it again as a new request if it must run"
        )


def text_row(r: TextRecord) -> dict[str, Any]:
    return {"request_id": r.request_id, "part": r.part, "idx": r.index, "salt": r.salt, "text": r.text,
            "token_ids": list(r.token_ids)}  # fmt: skip


def insert_texts(conn: Connection, records: Sequence[TextRecord]) -> None:
    """Insert the text rows not yet on record (a retried batch writes each once); inside the batch's transaction."""
    rows = {(r.request_id, r.part, r.index): r for r in reversed(records)}
    if not rows:
        return
    keys = list(rows)
    existing: set[tuple[str, str, int]] = set()
    for start in range(0, len(keys), _IN_CHUNK):
        chunk = keys[start : start + _IN_CHUNK]
        query = select(TEXTS.c.request_id, TEXTS.c.part, TEXTS.c.idx).where(
            tuple_(TEXTS.c.request_id, TEXTS.c.part, TEXTS.c.idx).in_(chunk)
        )
        existing.update((row.request_id, row.part, row.idx) for row in conn.execute(query))
    new = [text_row(r) for key, r in rows.items() if key not in existing]
    if new:
        conn.execute(insert(TEXTS), new)


def stored(conn: Connection, request_ids: Iterable[str]) -> dict[tuple[str, str, int], Any]:
    """The `request_texts` rows of request_ids, by (request_id, part, idx); an erased request has none."""
    ids = sorted(set(request_ids))
    found: dict[tuple[str, str, int], Any] = {}
    for start in range(0, len(ids), _IN_CHUNK):
        query = select(TEXTS).where(TEXTS.c.request_id.in_(ids[start : start + _IN_CHUNK]))
        for row in conn.execute(query):
            found[(row.request_id, row.part, row.idx)] = row
    return found


def prompt_token_ids(conn: Connection, request_ids: Iterable[str]) -> dict[str, list[int]]:
    """The prompt token ids kept in `request_texts` (revision 0013 on; erased prompts are absent)."""
    return {rid: list(row.token_ids) for (rid, part, _), row in stored(conn, request_ids).items() if part == PROMPT}


def kept_prompt_ids(store: Any, request_ids: Iterable[str]) -> dict[str, list[int]]:
    """prompt_token_ids read through an open AuditStore (recovery's resume: the prompts to re-run)."""
    with store.engine.connect() as conn:
        return prompt_token_ids(conn, request_ids)


def kept_for_resume(store: Any, request_ids: Iterable[str]) -> tuple[dict[tuple[str, str, int], Any], dict[str, int]]:
    """What recovery's resume reads through an open AuditStore: the text rows of request_ids (prompt, tools,
    constraint) by (request_id, part, idx), and the seq of the erasure of each that was erased."""
    ids = sorted(set(request_ids))
    x = Erasure.__table__
    with store.engine.connect() as conn:
        rows = stored(conn, ids)
        erased = {}
        for start in range(0, len(ids), _IN_CHUNK):
            query = select(x.c.request_id, x.c.seq).where(x.c.request_id.in_(ids[start : start + _IN_CHUNK]))
            erased.update((row.request_id, row.seq) for row in conn.execute(query))
    return rows, erased
