"""The ORM models: naming convention, typed nullability, lazy="raise", UTC times on both dialects."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy import insert, select, text
from sqlalchemy.orm import Session

from loraledger.store.models import Base, Completion, Request, utc_from_unix
from tests.db_fixtures import T0, sample_batch


def test_constraint_and_index_names_follow_the_convention():
    requests = Base.metadata.tables["requests"]
    assert requests.primary_key.name == "pk_requests"
    assert {fk.name for fk in requests.foreign_key_constraints} == {"fk_requests__adapter_fingerprint__adapters"}
    assert {ix.name for ix in requests.indexes} == {
        "ix_requests__adapter_fingerprint_received_at",
        "ix_requests__tenant_received_at",
        "ix_requests__received_at",
        "ix_requests__caller_request_id",
        "ix_requests__instance_id_received_at",
    }
    assert {c.name for c in Base.metadata.tables["events"].constraints} >= {"pk_events", "uq_events__dedup_key"}


def test_nullability_comes_from_the_annotations():
    columns = Base.metadata.tables["requests"].c
    assert columns.adapter_fingerprint.nullable and columns.tenant.nullable
    assert not columns.received_at.nullable and not columns.sampling_params.nullable


def test_relationships_never_load_lazily(audit_store):
    audit_store.write(sample_batch(["r1"]))
    with Session(audit_store.engine) as session:
        request = session.scalars(select(Request)).one()
        with pytest.raises(sa_exc.InvalidRequestError, match="lazy='raise'"):
            _ = request.completions
        completion = session.scalars(select(Completion)).one()
        with pytest.raises(sa_exc.InvalidRequestError, match="lazy='raise'"):
            _ = completion.request


def test_times_are_stored_as_utc_with_microseconds(audit_store):
    audit_store.write(sample_batch(["r1"]))
    with audit_store.engine.connect() as conn:
        raw = conn.execute(text("SELECT received_at FROM requests")).scalar_one()
    expected = utc_from_unix(T0)
    if audit_store.engine.dialect.name == "sqlite":
        assert raw == expected.strftime("%Y-%m-%d %H:%M:%S.%f+00:00")
    else:
        assert raw == expected and raw.utcoffset() == dt.timedelta(0)


def test_naive_times_are_refused(audit_store):
    row = {
        "seq": 1,
        "at": dt.datetime(2026, 1, 1),
        "kind": "engine_started",
        "request_id": None,
        "payload": {},
        "dedup_key": None,
        "prev_hash": "0" * 64,
        "hash": "0" * 64,
    }
    with pytest.raises(sa_exc.StatementError, match="naive datetime"), audit_store.engine.begin() as conn:
        conn.execute(insert(Base.metadata.tables["events"]), [row])
