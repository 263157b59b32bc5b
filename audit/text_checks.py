"""Salted text and its erasures, checked by verify (revision 0013 on): each commitment against its text, each
missing text against an erasure on record, each erasure against its `erased` event.

A binding or completion written with salted text commits to sha256(salt || text) and sha256(salt || ids); its
text row (`request_texts`) must match both, or be absent because `audit erase` removed it, which an `erasures`
row naming an `erased` event says. The `erased` event counts the requests, prompts and completions it erased (and,
revision 0016 on, their tools, constraints and tool calls, checked in audit/content_checks.py) and digests their
audit keys (DIGESTS.md section 4). Rows stream one at a time, so memory stays flat.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sqlalchemy import Connection, and_, func, literal, select

from loraledger.audit import content_checks
from loraledger.audit.problems import Problems
from loraledger.audit.queries import C, E, R, stream
from loraledger.audit.results import VerifyResult
from loraledger.audit.text_row_check import check_text_row
from loraledger.digests import ListDigest, text_commitment, token_ids_commitment
from loraledger.store.models import Erasure, RequestText
from loraledger.store.records import COMPLETION, PROMPT, EventKind

T = RequestText.__table__
X = Erasure.__table__


def _commitment_rows(conn: Connection) -> Iterator[tuple[str, str, int, Any]]:
    """(request_id, part, index, row) of every commitment on record, joined to its text row and its erasure."""
    prompts = (
        select(R.c.request_id, literal(PROMPT).label("part"), literal(0).label("idx"),
               R.c.prompt_commitment.label("text_commitment"),
               R.c.prompt_token_ids_commitment.label("ids_commitment"), R.c.prompt_text.label("inline_text"),
               literal(None).label("inline_ids"), T.c.salt, T.c.text, T.c.token_ids, X.c.seq.label("erased_at"))
        .select_from(R.outerjoin(T, and_(T.c.request_id == R.c.request_id, T.c.part == PROMPT, T.c.idx == 0))
                     .outerjoin(X, X.c.request_id == R.c.request_id))
        .where(R.c.prompt_token_ids_commitment.is_not(None))
        .order_by(R.c.request_id)
    )  # fmt: skip
    for row in stream(conn, prompts):
        yield row.request_id, PROMPT, 0, row
    completions = (
        select(C.c.request_id, C.c.completion_index.label("idx"), C.c.text_commitment,
               C.c.token_ids_commitment.label("ids_commitment"), C.c.text.label("inline_text"),
               C.c.token_ids.label("inline_ids"), T.c.salt, T.c.text, T.c.token_ids, X.c.seq.label("erased_at"))
        .select_from(C.outerjoin(T, and_(T.c.request_id == C.c.request_id, T.c.part == COMPLETION,
                                         T.c.idx == C.c.completion_index))
                     .outerjoin(X, X.c.request_id == C.c.request_id))
        .where(C.c.text_commitment.is_not(None))
        .order_by(C.c.request_id, C.c.completion_index)
    )  # fmt: skip
    for row in stream(conn, completions):
        yield row.request_id, COMPLETION, row.idx, row


def _matches(row: Any) -> bool:
    try:
        text_ok = (row.text is None and row.text_commitment is None) or (
            row.text is not None and text_commitment(row.salt, row.text) == row.text_commitment
        )
        return text_ok and token_ids_commitment(row.salt, list(row.token_ids)) == row.ids_commitment
    except (TypeError, ValueError):  # a salt that is not 32 hex digits, ids that are not a list of ints
        return False


def check_texts(conn: Connection, found: Problems) -> int:
    """Every commitment against its text row or its erasure; returns how many text rows are erased."""
    erased = 0
    for rid, part, idx, row in _commitment_rows(conn):
        where = "the prompt" if part == PROMPT else f"completion {idx}"
        key = {"request_id": rid, "part": part, "idx": idx}
        seq = row.erased_at
        inline = row.inline_text not in (None, "") or (part == COMPLETION and row.inline_ids not in (None, []))
        if inline:
            found.add(seq, f"{where} of {rid!r} holds its text in `{'requests' if part == PROMPT else 'completions'}` "
                      "beside a salted commitment (it belongs in `request_texts` alone)", rid,
                      table="requests" if part == PROMPT else "completions", key={"request_id": rid})  # fmt: skip
        said = {
            "missing": f"the text of {where} of {rid!r} is missing from `request_texts`, and no erasure of it is on "
            "record",
            "erased": f"{where} of {rid!r} was erased (event {seq}) but its text is still in `request_texts`",
            "mismatch": f"the text of {where} of {rid!r} in `request_texts` does not match its commitment",
        }
        erased += check_text_row(found, row, _matches, key, said.__getitem__)
    erased += content_checks.check_content(conn, found)
    _check_orphans(conn, found)
    return erased


def _check_orphans(conn: Connection, found: Problems) -> None:
    """Text rows that no commitment vouches for."""
    prompt = and_(T.c.part == PROMPT, T.c.idx == 0, R.c.prompt_token_ids_commitment.is_not(None))
    completion = and_(T.c.part == COMPLETION, C.c.text_commitment.is_not(None))
    content = [~content_checks.vouched(part) for part in content_checks.PARTS]  # tools, constraint, tool calls
    query = (
        select(T.c.request_id, T.c.part, T.c.idx)
        .select_from(T.outerjoin(R, R.c.request_id == T.c.request_id)
                     .outerjoin(C, and_(C.c.request_id == T.c.request_id, C.c.completion_index == T.c.idx)))
        .where(~prompt, ~completion, *content)
        .order_by(T.c.request_id, T.c.part, T.c.idx)
    )  # fmt: skip
    for row in stream(conn, query):
        found.add(None, f"`request_texts` holds text for {row.part} {row.idx} of {row.request_id!r}, which no "
                  "commitment on record vouches for", row.request_id, table="request_texts",
                  key={"request_id": row.request_id, "part": row.part, "idx": row.idx})  # fmt: skip


def _counts(conn: Connection, seq: int) -> tuple[int, int]:
    """(prompts, completions) with commitments among the requests the erasure at seq erased."""
    ids = select(X.c.request_id).where(X.c.seq == seq)
    prompts = (
        select(func.count()).select_from(R).where(R.c.request_id.in_(ids), R.c.prompt_token_ids_commitment.is_not(None))
    )
    completions = select(func.count()).select_from(C).where(C.c.request_id.in_(ids), C.c.text_commitment.is_not(None))
    return int(conn.execute(prompts).scalar_one()), int(conn.execute(completions).scalar_one())


def check_erasures(conn: Connection, found: Problems) -> None:
    """Each `erased` event against the `erasures` rows naming it, and each `erasures` row against an `erased` event."""
    events = {
        row.seq: row.payload for row in conn.execute(select(E.c.seq, E.c.payload).where(E.c.kind == EventKind.ERASED))
    }
    sha: dict[int, ListDigest] = {}
    count: dict[int, int] = {}
    for row in stream(conn, select(X.c.request_id, X.c.seq).order_by(X.c.seq, X.c.request_id)):
        if row.seq not in events:
            found.add(row.seq, f"`erasures` names event {row.seq} for {row.request_id!r}, which is not an erased event",
                      row.request_id, table="erasures", key={"request_id": row.request_id})  # fmt: skip
            continue
        sha.setdefault(row.seq, ListDigest()).add(row.request_id)
        count[row.seq] = count.get(row.seq, 0) + 1
    for seq, payload in events.items():
        payload = payload if isinstance(payload, dict) else {}
        n, digest = count.get(seq, 0), sha.get(seq, ListDigest()).hexdigest()
        if payload.get("requests") != n or payload.get("requests_sha256") != digest:
            message = (f"the erased event {seq} names {payload.get('requests')!r} requests, but the `erasures` rows "
                       f"naming it are {n} (or name other requests)")  # fmt: skip
            found.add(seq, message, table="events", key={"seq": seq})
            rows = (
                select(X.c.request_id).where(X.c.seq == seq).order_by(X.c.request_id).limit(VerifyResult.MAX_PROBLEMS)
            )
            for rid in conn.execute(rows).scalars():  # each row it may concern, so a reader can find the edited one
                found.add(seq, message, rid, table="erasures", key={"request_id": rid})
            continue
        prompts, completions = _counts(conn, seq)
        if (payload.get("prompts"), payload.get("completions")) != (prompts, completions):
            found.add(seq, f"the erased event {seq} counts {payload.get('prompts')!r} prompts and "
                      f"{payload.get('completions')!r} completions, but its requests have {prompts} and {completions}",
                      table="events", key={"seq": seq})  # fmt: skip
        if "tool_calls" in payload:  # revision 0016 on: the tools, constraints and tool calls it erased
            has = content_checks.counts(conn, select(X.c.request_id).where(X.c.seq == seq))
            said = {name: payload.get(name) for name in has}
            if said != has:
                found.add(seq, f"the erased event {seq} counts {said} but its requests have {has}", table="events",
                          key={"seq": seq})  # fmt: skip
