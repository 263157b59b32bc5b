"""verify checks each tools, constraint and tool-calls commitment (revision 0016 on) against its salted text row: a
forged text, a forged salt, token ids slipped into the row, a row gone without an erasure, the text put back inline
beside its commitment, a row no commitment vouches for, and an erased event whose counts do not match; each problem
names its row (SQLite and PostgreSQL)."""

from __future__ import annotations

import pytest
from sqlalchemy import delete, insert, update

from loraledger.audit.erase import erase
from loraledger.audit.verify import verify_log
from loraledger.store.audit_store import AuditStore
from loraledger.store.db import make_engine, write_transaction
from loraledger.store.models import Completion, Event, Request, RequestText
from tests.audit.salted import write_salted
from tests.audit.test_verify_columns import unguarded

T, R, C, E = RequestText.__table__, Request.__table__, Completion.__table__, Event.__table__
PARTS = [
    ("tools", 0, "tools_commitment"),
    ("constraint", 0, "constraint_commitment"),
    ("tool_calls", 1, "tool_calls_commitment"),
]


@pytest.fixture
def log(db_url):
    with AuditStore(db_url) as store:
        write_salted(store, ["kept", "gone"], at=1_764_000_000.0, tenant="acme")
        with write_transaction(store.engine) as conn:
            erase(conn, request_id="gone", reason="asked")
    engine = make_engine(db_url)
    with engine.connect() as conn:
        assert verify_log(conn).ok
    yield engine
    engine.dispose()


def _row(part: str, idx: int):
    return (T.c.request_id == "kept") & (T.c.part == part) & (T.c.idx == idx)


def _problems(conn, table: str, key: dict) -> list[str]:
    result = verify_log(conn)
    assert not result.ok
    return [p.message for p in result.problems if p.table == table and p.key == key]


@pytest.mark.parametrize(("part", "idx", "commitment"), PARTS)
def test_a_forged_text_salt_or_token_ids_is_named_at_its_row(log, part, idx, commitment):
    key = {"request_id": "kept", "part": part, "idx": idx}
    for values in ({"text": '"forged"'}, {"salt": "ab" * 16}, {"token_ids": [1]}):
        with unguarded(log) as conn:
            conn.execute(update(T).where(_row(part, idx)).values(values))
            found = _problems(conn, "request_texts", key)
        assert any("do not match" in m and commitment in m for m in found), (values, found)


@pytest.mark.parametrize(("part", "idx", "commitment"), PARTS)
def test_text_gone_without_an_erasure_is_named(log, part, idx, commitment):
    with unguarded(log) as conn:
        conn.execute(delete(T).where(_row(part, idx)))
        found = _problems(conn, "request_texts", {"request_id": "kept", "part": part, "idx": idx})
    assert any("missing" in m and "no erasure" in m for m in found), found


@pytest.mark.parametrize(("part", "idx", "column"), [("tools", 0, "tools_text"), ("constraint", 0, "constraint_text"),
                                                     ("tool_calls", 1, "tool_calls")])  # fmt: skip
def test_text_put_back_inline_beside_its_commitment_is_named(log, part, idx, column):
    table = R if part != "tool_calls" else C
    where = table.c.request_id == "gone"
    if table is C:
        where = where & (C.c.completion_index == idx)
    with unguarded(log) as conn:
        conn.execute(update(table).where(where).values({column: "restored from a backup"}))
        result = verify_log(conn)
    assert not result.ok
    assert any(p.table == table.name and "beside a salted commitment" in p.message for p in result.problems)


def test_a_text_row_no_commitment_vouches_for_is_named(log):
    with unguarded(log) as conn:
        conn.execute(update(R).where(R.c.request_id == "kept").values(tools_commitment=None))
        result = verify_log(conn)
    assert any(p.table == "request_texts" and "no commitment" in p.message and p.key["part"] == "tools"
               for p in result.problems), result.problems  # fmt: skip


def test_text_of_an_erased_request_written_back_is_named(log):
    with unguarded(log) as conn:
        conn.execute(
            insert(T).values(request_id="gone", part="constraint", idx=0, salt="00" * 16, text="{}", token_ids=[])
        )
        result = verify_log(conn)
    assert any(p.table == "request_texts" and "were erased" in p.message for p in result.problems), result.problems


def test_an_erased_event_whose_content_counts_do_not_match_is_named(log):
    with unguarded(log) as conn:
        # one tool-calls commitment fewer among the erased request's completions than its event counts
        conn.execute(
            update(C).where(C.c.request_id == "gone", C.c.completion_index == 0).values(tool_calls_commitment=None)
        )
        result = verify_log(conn)
    assert any(p.table == "events" and "'tool_calls': 1" in p.message for p in result.problems), result.problems
