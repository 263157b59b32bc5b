"""AuditStore: atomic, idempotent group commits; the hash chain; what recovery reads back."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from sqlalchemy import event, func, select
from sqlalchemy import exc as sa_exc

from loraledger.digests import GENESIS_HASH, verify_chain
from loraledger.errors import AuditIntegrityError, AuditSchemaError, AuditUnavailableError, DuplicateRequestError
from loraledger.store import audit_store as audit_store_module
from loraledger.store.audit_store import ADAPTERS, COMPLETIONS, EVENTS, REQUESTS, AuditStore
from loraledger.store.db import make_engine
from loraledger.store.migrate import upgrade
from loraledger.store.records import AuditBatch, EventKind, EventRecord
from tests.db_fixtures import FP_A, FP_B, T0, make_adapter, make_completion, make_request, sample_batch


def counts(store: AuditStore) -> dict[str, int]:
    with store.engine.connect() as conn:
        tables = (ADAPTERS, REQUESTS, COMPLETIONS, EVENTS)
        return {t.name: conn.execute(select(func.count()).select_from(t)).scalar_one() for t in tables}


def events(store: AuditStore) -> list:
    with store.engine.connect() as conn:
        return conn.execute(select(EVENTS).order_by(EVENTS.c.seq)).all()


def test_open_migrates_a_new_empty_database(db_url):
    with AuditStore(db_url) as store:
        assert store.head().sequence == 0 and store.head().hash == GENESIS_HASH
        assert counts(store) == {"adapters": 0, "requests": 0, "completions": 0, "events": 0}


def test_write_stores_every_record_with_utc_microsecond_times(audit_store):
    checkpoint = audit_store.write(sample_batch(["r1", "r2"]))
    # the adapter's first row enters the chain with it: one adapter_registered event before the batch's own
    assert counts(audit_store) == {"adapters": 1, "requests": 2, "completions": 2, "events": 5}
    assert checkpoint == audit_store.head() and checkpoint.sequence == 5
    assert checkpoint.at == pytest.approx(T0 + 0.02, abs=1e-6)
    with audit_store.engine.connect() as conn:
        request = conn.execute(select(REQUESTS).where(REQUESTS.c.request_id == "r1")).one()
        completion = conn.execute(select(COMPLETIONS).where(COMPLETIONS.c.request_id == "r1")).one()
    assert request.received_at == dt.datetime.fromtimestamp(T0, dt.timezone.utc)
    assert request.received_at.tzinfo is not None and request.received_at.microsecond == 123456
    assert request.sampling_params == make_request("r1").sampling_params
    assert completion.token_ids == [5, 6, 7, 8] and completion.completion_index == 0
    assert completion.adapter_fingerprint == FP_A


def test_the_same_batch_twice_is_written_once(audit_store):
    batch = sample_batch(["r1", "r2"])
    first = audit_store.write(batch)
    assert audit_store.write(batch) == first
    assert counts(audit_store) == {"adapters": 1, "requests": 2, "completions": 2, "events": 5}
    # a dedup key seen earlier in the same batch is skipped as well
    twice = EventRecord(kind=EventKind.ENGINE_STARTED, at=T0, dedup_key="started:1")
    assert audit_store.write(AuditBatch(events=[twice, twice])).sequence == 6


def test_events_without_a_dedup_key_are_always_appended(audit_store):
    event = EventRecord(kind=EventKind.ADAPTER_LOADED, at=T0, payload={"name": "alpha"})
    audit_store.write(AuditBatch(events=[event]))
    assert audit_store.write(AuditBatch(events=[event])).sequence == 2


def test_a_conflicting_binding_raises_and_writes_nothing(audit_store):
    audit_store.write(sample_batch(["r1"]))
    before = counts(audit_store)
    conflicting = sample_batch(["r2", "r1"], FP_B)
    with pytest.raises(DuplicateRequestError, match=r"'r1'.*adapter_fingerprint"):
        audit_store.write(conflicting)
    assert counts(audit_store) == before
    with pytest.raises(DuplicateRequestError, match="twice in one audit batch"):
        audit_store.write(AuditBatch(requests=[make_request("r9"), make_request("r9", tenant="other")]))
    assert counts(audit_store) == before


def test_a_refused_completion_leaves_nothing_of_its_batch(audit_store):
    batch = sample_batch(["r1"])
    bad = AuditBatch(
        adapters=batch.adapters, requests=batch.requests, completions=[make_completion("r1", FP_B)], events=batch.events
    )
    with pytest.raises(AuditIntegrityError, match="refused the batch"):
        audit_store.write(bad)
    assert counts(audit_store) == {"adapters": 0, "requests": 0, "completions": 0, "events": 0}


def test_an_operational_failure_mid_batch_is_unavailable_and_rolled_back(audit_store, monkeypatch):
    def lose_connection(conn, records, instance_id=None, **kwargs):
        raise sa_exc.OperationalError("INSERT INTO events", {}, Exception("server closed the connection"))

    monkeypatch.setattr(audit_store_module, "append_events", lose_connection)
    with pytest.raises(AuditUnavailableError, match="unreachable.*server closed the connection"):
        audit_store.write(sample_batch(["r1"]))
    monkeypatch.undo()
    assert counts(audit_store) == {"adapters": 0, "requests": 0, "completions": 0, "events": 0}


def test_the_chain_verifies_after_many_writes_and_names_a_tampered_row(audit_store):
    for i in range(12):
        audit_store.write(sample_batch([f"r{i}a", f"r{i}b"], FP_A if i % 2 else None, at=T0 + i))
    assert audit_store.head().sequence == 49  # 48 and the adapter's registration
    assert audit_store.first_break() is None
    rows = events(audit_store)
    assert [r.seq for r in rows] == list(range(1, 50)) and rows[0].prev_hash == GENESIS_HASH
    assert all(rows[i].prev_hash == rows[i - 1].hash for i in range(1, 49))

    engine = make_engine(audit_store.url)  # a raw connection with the guard dropped, as an intruder would
    with engine.begin() as conn:
        on = " ON events" if conn.dialect.name == "postgresql" else ""
        conn.exec_driver_sql(f"DROP TRIGGER events_no_update{on}")
        conn.execute(EVENTS.update().where(EVENTS.c.seq == 17).values(payload={"n": 999}))
    engine.dispose()
    assert verify_chain(events(audit_store)) == 17
    assert audit_store.first_break().seq == 17
    with pytest.raises(AuditSchemaError, match="events_no_update"):
        AuditStore(audit_store.url).open()


def test_unfinished_requests_are_those_without_a_terminal_event(audit_store):
    audit_store.write(sample_batch(["done"], at=T0))
    audit_store.write(sample_batch(["late", "early"], None, finished=False, at=T0 + 5))
    audit_store.write(sample_batch(["first"], finished=False, at=T0 - 5))
    audit_store.write(AuditBatch(events=[EventRecord(kind=EventKind.REQUEST_PREEMPTED, at=T0 + 6, request_id="late")]))
    unfinished = audit_store.unfinished_requests()
    assert [r.request_id for r in unfinished] == ["first", "early", "late"]
    assert unfinished[0] == make_request("first", at=T0 - 5)
    interrupted = EventRecord(kind=EventKind.REQUEST_INTERRUPTED, at=T0 + 7, request_id="first")
    audit_store.write(AuditBatch(events=[interrupted]))
    assert [r.request_id for r in audit_store.unfinished_requests()] == ["early", "late"]


def test_existing_request_ids(audit_store):
    audit_store.write(sample_batch(["r1", "r2"]))
    assert audit_store.existing_request_ids(["r2", "r3", "r1", "r2"]) == {"r1", "r2"}
    assert audit_store.existing_request_ids([]) == set()


def test_concurrent_writers_keep_one_gapless_chain(migrated_db_url):
    stores = [AuditStore(migrated_db_url).open() for _ in range(2)]
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            for i in range(8):
                stores[k].write(sample_batch([f"w{k}-{i}"], FP_A))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert stores[0].head().sequence == 33 and stores[0].first_break() is None  # 32 and FP_A's registration
    for store in stores:
        store.close()


def _statements(store: AuditStore, batch: AuditBatch) -> tuple[int, int]:
    """(statements sent to the database, the chain's head sequence after) for one group commit of batch."""
    sent = []

    def note(conn, cursor, statement, parameters, context, executemany):
        sent.append(statement)

    event.listen(store.engine, "before_cursor_execute", note)
    try:
        sequence = store.write(batch).sequence
    finally:
        event.remove(store.engine, "before_cursor_execute", note)
    return len(sent), sequence


def test_a_group_commit_of_hundreds_of_records_costs_no_more_round_trips_than_one_of_a_few(audit_store):
    """A group commit writes each table with one statement for all its rows, so its round trips do not grow with
    its size: what makes it fast (its speed is measured by `python -m bench.run --only audit-chain`)."""
    audit_store.write(AuditBatch(adapters=[make_adapter(FP_B, "beta", 2)]))
    few, _ = _statements(audit_store, sample_batch([f"few-{i}" for i in range(3)]))
    # 300 requests, 300 completions, 600 events
    many, sequence = _statements(audit_store, sample_batch([f"req-{i}" for i in range(300)]))
    assert sequence == 608  # after beta's registration and the few
    assert many == few, f"a 1,200-row group commit sent {many} statements, one of 12 rows {few}"


def test_an_unreachable_database_is_unavailable():
    url = "postgresql://auditor:secret@127.0.0.1:1/audit"
    with pytest.raises(AuditUnavailableError, match=r"unreachable") as info:
        AuditStore(url).open()
    assert "127.0.0.1:1/audit" in str(info.value) and "secret" not in str(info.value)
    with pytest.raises(AuditUnavailableError, match="unreachable"):
        upgrade(url)


def test_an_unopenable_sqlite_file_is_unavailable(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(AuditUnavailableError, match="unreachable"):
        AuditStore(f"sqlite:///{tmp_path / 'file' / 'audit.sqlite3'}").open()


def test_writing_before_open_is_unavailable(tmp_path):
    with pytest.raises(AuditUnavailableError, match="not open"):
        AuditStore(f"sqlite:///{tmp_path / 'a.sqlite3'}").write(AuditBatch())
