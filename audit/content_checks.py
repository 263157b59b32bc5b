"""Caller content kept apart under salts (revision 0016 on), checked by verify: a request's tool definitions and its
constraint's text, and each completion's tool calls. Each has one commitment, sha256(salt || text), in the row the
chain covers (`requests.tools_commitment`, `requests.constraint_commitment`, `completions.tool_calls_commitment`);
its `request_texts` row (parts "tools", "constraint", "tool_calls", no token ids) must match it, or be gone because
`audit erase` removed it (an `erasures` row on record). Rows stream one at a time, so memory stays flat.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sqlalchemy import Connection, and_, func, literal, select

from loraledger.audit.problems import Problems
from loraledger.audit.queries import C, R, stream
from loraledger.audit.text_row_check import check_text_row
from loraledger.digests import text_commitment
from loraledger.store.models import Erasure, RequestText
from loraledger.store.texts import CONSTRAINT, TOOL_CALLS, TOOLS

T = RequestText.__table__
X = Erasure.__table__

# part -> (table, the commitment column, the column that held the text inline before revision 0016, what it is)
PARTS = {
    TOOLS: (R, "tools_commitment", "tools_text", "the tool definitions"),
    CONSTRAINT: (R, "constraint_commitment", "constraint_text", "the constraint's text"),
    TOOL_CALLS: (C, "tool_calls_commitment", "tool_calls", "the tool calls"),
}


def vouched(part: str) -> Any:
    """The condition (on `request_texts` T joined to its request R and completion C) that a commitment vouches for a
    text row of part."""
    table, commitment, _, _ = PARTS[part]
    at = T.c.idx == 0 if table is R else literal(True)
    return and_(T.c.part == part, at, table.c[commitment].is_not(None))


def _rows(conn: Connection, part: str) -> Iterator[Any]:
    table, commitment, inline, _ = PARTS[part]
    idx = literal(0) if table is R else C.c.completion_index
    on = and_(T.c.request_id == table.c.request_id, T.c.part == part, T.c.idx == idx)
    query = (
        select(table.c.request_id, idx.label("idx"), table.c[commitment].label("commitment"),
               table.c[inline].label("inline"), T.c.salt, T.c.text, T.c.token_ids, X.c.seq.label("erased_at"))
        .select_from(table.outerjoin(T, on).outerjoin(X, X.c.request_id == table.c.request_id))
        .where(table.c[commitment].is_not(None))
        .order_by(table.c.request_id, idx)
    )  # fmt: skip
    yield from stream(conn, query)


def _matches(row: Any) -> bool:
    try:
        return (
            row.text is not None
            and text_commitment(row.salt, row.text) == row.commitment
            and list(row.token_ids) == []  # ids here would be content no commitment covers
        )
    except (TypeError, ValueError):  # a salt that is not 32 hex digits, ids that are not a list
        return False


def check_content(conn: Connection, found: Problems) -> int:
    """Every tools, constraint and tool-calls commitment against its text row or its erasure; returns how many of
    those rows are erased."""
    erased = 0
    for part, (table, commitment, inline, what) in PARTS.items():
        for row in _rows(conn, part):
            rid, seq = row.request_id, row.erased_at
            where = what if table is R else f"{what} of completion {row.idx}"
            key = {"request_id": rid, "part": part, "idx": row.idx}
            if row.inline is not None:
                row_key = {"request_id": rid} if table is R else {"request_id": rid, "completion_index": row.idx}
                found.add(seq, f"{where} of {rid!r} are held in `{table.name}.{inline}` beside a salted commitment "
                          "(they belong in `request_texts` alone)", rid, table=table.name, key=row_key)  # fmt: skip
            said = {
                "missing": f"{where} of {rid!r} are missing from `request_texts` (part {part!r}), and no erasure of "
                "them is on record",
                "erased": f"{where} of {rid!r} were erased (event {seq}) but are still in `request_texts`",
                "mismatch": f"{where} of {rid!r} in `request_texts` (part {part!r}) do not match their `{commitment}`",
            }
            erased += check_text_row(found, row, _matches, key, said.__getitem__)
    return erased


def counts(conn: Connection, ids: Any) -> dict[str, int]:
    """How many tools, constraint and tool-calls commitments the requests ids (a subquery or list) have: an `erased`
    event's counts `tools`, `constraints`, `tool_calls` (revision 0016 on)."""
    out = {}
    for part, name in ((TOOLS, "tools"), (CONSTRAINT, "constraints"), (TOOL_CALLS, "tool_calls")):
        table, commitment, _, _ = PARTS[part]
        query = (
            select(func.count()).select_from(table).where(table.c.request_id.in_(ids), table.c[commitment].is_not(None))
        )
        out[name] = int(conn.execute(query).scalar_one())
    return out
