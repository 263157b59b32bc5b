"""Adapter rows enter the hash chain: the store writes one adapter_registered event with each new `adapters` row."""

from __future__ import annotations

from sqlalchemy import select

from loraledger.digests import digest
from loraledger.store.audit_store import ADAPTERS, EVENTS
from loraledger.store.records import AuditBatch, EventKind
from loraledger.store.registration import registered_form, registration_key, unregistered
from loraledger.store.rows import adapter_row
from tests.db_fixtures import FP_A, FP_B, T0, make_adapter, sample_batch


def test_a_new_adapter_row_is_registered_before_the_events_that_name_it(audit_store):
    audit_store.write(sample_batch(["r1"]))
    with audit_store.engine.connect() as conn:
        events = conn.execute(select(EVENTS).order_by(EVENTS.c.seq)).all()
        row = conn.execute(select(ADAPTERS)).one()
    first = events[0]
    assert [e.kind for e in events] == [
        EventKind.ADAPTER_REGISTERED,
        EventKind.REQUEST_ADMITTED,
        EventKind.REQUEST_FINISHED,
    ]
    assert first.dedup_key == registration_key(FP_A) and first.request_id is None
    assert first.at.timestamp() == row.first_seen.timestamp()
    # the payload is the row, every column, as read back
    assert (
        first.payload["adapter"] == registered_form(dict(row._mapping)) == registered_form(adapter_row(make_adapter()))
    )
    assert first.payload["adapter_sha256"] == digest(first.payload["adapter"])


def test_an_adapter_is_registered_once_whatever_name_it_comes_back_under(audit_store):
    audit_store.write(AuditBatch(adapters=[make_adapter(FP_A, "alpha"), make_adapter(FP_A, "renamed", 7)]))
    audit_store.write(AuditBatch(adapters=[make_adapter(FP_A, "again", 9), make_adapter(FP_B, "beta", 2)]))
    with audit_store.engine.connect() as conn:
        events = conn.execute(select(EVENTS).order_by(EVENTS.c.seq)).all()
        assert conn.execute(unregistered(ADAPTERS, EVENTS)).all() == []
        names = dict(conn.execute(select(ADAPTERS.c.fingerprint, ADAPTERS.c.name)).all())
    assert [(e.payload["adapter"]["fingerprint"], e.payload["adapter"]["name"]) for e in events] == [
        (FP_A, "alpha"),
        (FP_B, "beta"),
    ]
    assert names == {FP_A: "alpha", FP_B: "beta"}  # the first row of a fingerprint stays, as its event says
    assert events[0].at.timestamp() == T0
