"""Schema migrations: built only by Alembic, upgradable from every earlier revision, checked at open."""

from __future__ import annotations

import time

import pytest
from alembic import command
from sqlalchemy import MetaData, Table, func, select, text

from loraledger.audit import AuditLog
from loraledger.errors import AuditSchemaError
from loraledger.store import audit_store
from loraledger.store.audit_store import EVENTS, REQUESTS, write_batch
from loraledger.store.db import make_engine, write_transaction
from loraledger.store.guards import guards_present
from loraledger.store.migrate import _scripts, alembic_config, current_revision, ensure_schema, head_revision, upgrade
from loraledger.store.models import Base
from loraledger.store.records import EventKind

EARLIER = [script.revision for script in _scripts().walk_revisions() if script.revision != head_revision()]
# columns a revision added: a database at an earlier revision is written the way loraledger wrote it then
# (revision, table, column): the columns a revision added; (revision, table): the tables it added
ADDED_COLUMNS = [
    ("0005_key_id", "requests", "key_id"),
    ("0006_request_identity", "requests", "caller_request_id"),
    ("0006_request_identity", "requests", "chat_template_sha256"),
    ("0007_instances", "requests", "instance_id"),
    ("0007_instances", "events", "instance_id"),
    ("0008_structured_outputs", "requests", "constraint_kind"),
    ("0008_structured_outputs", "requests", "constraint_sha256"),
    ("0008_structured_outputs", "requests", "constraint_text"),
    *(("0009_hub_sources", "adapters", c) for c in ("repo_id", "revision", "commit_sha")),
    *(("0009_hub_sources", "requests", f"adapter_{c}") for c in ("repo_id", "revision", "commit_sha")),
    *(
        ("0009_hub_sources", "instances", f"{what}{c}")
        for what in ("model", "tokenizer")
        for c in ("", "_repo_id", "_revision", "_commit_sha")
    ),
    *(("0013_text_erasure", "requests", c) for c in ("prompt_commitment", "prompt_token_ids_commitment")),
    *(("0013_text_erasure", "completions", c) for c in ("text_commitment", "token_ids_commitment")),
    ("0014_tool_calls", "requests", "tools_sha256"),
    ("0014_tool_calls", "requests", "tools_text"),
    ("0014_tool_calls", "completions", "tool_calls"),
    *(
        ("0015_base_quantization", "instances", c)
        for c in ("quantization", "quant_method", "quant_bits", "quant_group_size", "quant_source_fingerprint")
    ),
    *(
        ("0016_erasable_caller_content", "requests", c)
        for c in ("tools_commitment", "constraint_commitment", "tool_reading")
    ),
    ("0016_erasable_caller_content", "completions", "tool_calls_commitment"),
]
ADDED_TABLES = [
    ("0007_instances", "instances"),
    ("0007_instances", "instance_leases"),
    ("0010_merkle_tree", "merkle_nodes"),
    ("0011_receipts_and_checkpoints", "checkpoints"),
    ("0011_receipts_and_checkpoints", "receipts"),
    ("0013_text_erasure", "request_texts"),
    ("0013_text_erasure", "erasures"),
]


def _revisions_after(start: str) -> set[str]:
    return {s.revision for s in _scripts().iterate_revisions(head_revision(), start)} - {start}


def write_as_of(engine, start: str, batch, monkeypatch: pytest.MonkeyPatch) -> None:
    """Write batch into a database at revision `start`, without the columns later revisions added."""
    with monkeypatch.context() as patch:
        if "0010_merkle_tree" in _revisions_after(start):  # no Merkle tree yet: revision 0010 builds it
            from loraledger.evidence import node_store

            patch.setattr(node_store, "append_leaves", lambda conn, first_index, hashes: None)
        if "0013_text_erasure" in _revisions_after(start):  # no erasures table yet: nothing can have been erased
            patch.setattr(audit_store.texts, "refuse_after_erasure", lambda conn, batch: None)
        for table, current, make_row in (
            ("requests", REQUESTS, "request_row"),
            ("adapters", audit_store.ADAPTERS, "adapter_row"),
            ("completions", audit_store.COMPLETIONS, "completion_row"),
        ):
            dropped = {c for rev, t, c in ADDED_COLUMNS if rev in _revisions_after(start) and t == table}
            if dropped:
                old = Table(table, MetaData(), *(c._copy() for c in current.columns if c.name not in dropped))
                patch.setattr(audit_store, table.upper(), old)
                patch.setattr(audit_store, make_row, _without(getattr(audit_store, make_row), dropped))
        with write_transaction(engine) as conn:
            write_batch(conn, batch)


def _without(make_row, dropped: set[str]):
    return lambda record: {k: v for k, v in make_row(record).items() if k not in dropped}


def drop_guard(url: str, name: str) -> None:
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TRIGGER {name}" + (" ON events" if conn.dialect.name == "postgresql" else ""))
    engine.dispose()


def test_revisions_are_dated_and_linear():
    scripts = list(_scripts().walk_revisions())
    assert head_revision() == scripts[0].revision
    assert [s.revision for s in reversed(scripts)][:2] == ["0001_initial", "0002_guards"]
    for script in scripts:
        name = script.path.rsplit("/", 1)[-1]
        assert name[:11].replace("_", "").isdigit(), f"{name} does not start with a date"


def test_nothing_but_the_migrations_creates_the_schema():
    from importlib.resources import files

    for package in ("loraledger.store", "loraledger.migrations", "loraledger.migrations.versions"):
        for path in files(package).iterdir():
            if path.name.endswith(".py"):
                assert ".create_all(" not in path.read_text(), f"{path} creates tables outside the migrations"


def test_empty_database_upgrades_to_head_with_every_guard(db_url):
    assert upgrade(db_url) == head_revision()
    engine = make_engine(db_url)
    with engine.connect() as conn:
        assert current_revision(conn) == head_revision()
        assert guards_present(conn) == []
        # no drift between the ORM models and what the migrations built
        command.check(alembic_config(conn))
    engine.dispose()


@pytest.mark.parametrize("start", EARLIER)
def test_upgrade_from_every_earlier_revision_keeps_the_rows(db_url, start, monkeypatch):
    assert upgrade(db_url, start) == start
    engine = make_engine(db_url)
    with pytest.raises(AuditSchemaError, match=r"behind head.*loraledger db upgrade --url"):
        ensure_schema(engine, db_url)
    from tests.audit.synth import build_log

    synth = build_log(_StoreAsOf(engine, start, monkeypatch), n_requests=8, days=1, key_ids=False)
    assert upgrade(db_url) == head_revision()
    with engine.connect() as conn:
        assert guards_present(conn) == []
        assert conn.execute(select(func.count()).select_from(REQUESTS)).scalar_one() == len(synth.requests)
        assert set(conn.execute(select(REQUESTS.c.key_id)).scalars()) == {None}  # rows on record before 0005
        if "0006_request_identity" in _revisions_after(
            start
        ):  # rows on record before 0006: request_id is the caller's id
            assert set(conn.execute(select(REQUESTS.c.caller_request_id, REQUESTS.c.chat_template_sha256))) == {
                (None, None)
            }
        assert set(conn.execute(select(REQUESTS.c.constraint_sha256)).scalars()) == {None}  # and before 0008
    ensure_schema(engine, db_url)
    engine.dispose()
    with AuditLog(db_url) as log:  # the rows written before the upgrade verify after it
        result = log.verify()
    assert result.ok, result.problems


def test_ensure_schema_migrates_only_an_empty_database(db_url):
    engine = make_engine(db_url)
    ensure_schema(engine, db_url)
    with engine.connect() as conn:
        assert current_revision(conn) == head_revision()
        assert guards_present(conn) == []
    engine.dispose()


def test_a_database_with_foreign_tables_is_refused(db_url):
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE something_else (x INTEGER)")
    with pytest.raises(AuditSchemaError, match=r"something_else.*no loraledger schema revision.*db upgrade"):
        ensure_schema(engine, db_url)
    engine.dispose()


def test_missing_guards_are_refused_then_reinstalled_by_upgrade(migrated_db_url):
    drop_guard(migrated_db_url, "events_no_update")
    engine = make_engine(migrated_db_url)
    with engine.connect() as conn:
        assert guards_present(conn) == ["events_no_update"]
    with pytest.raises(AuditSchemaError, match=r"events_no_update.*run `loraledger db upgrade --url \S+`"):
        ensure_schema(engine, migrated_db_url)
    upgrade(migrated_db_url)
    with engine.connect() as conn:
        assert guards_present(conn) == []
    ensure_schema(engine, migrated_db_url)
    engine.dispose()


def test_downgrade_is_refused_and_changes_nothing(migrated_db_url):
    engine = make_engine(migrated_db_url)
    with engine.begin() as conn, pytest.raises(AuditSchemaError, match="refused"):
        command.downgrade(alembic_config(conn), "0001_initial")
    with pytest.raises(AuditSchemaError, match="downgrades are refused"):
        upgrade(migrated_db_url, "0001_initial")
    with engine.connect() as conn:
        assert current_revision(conn) == head_revision()
        assert guards_present(conn) == []
    engine.dispose()


def test_an_unknown_newer_revision_is_refused(migrated_db_url):
    engine = make_engine(migrated_db_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999_future'"))
    with pytest.raises(AuditSchemaError, match="does not know: a newer loraledger made it"):
        ensure_schema(engine, migrated_db_url)
    engine.dispose()


class _StoreAsOf:
    """An AuditStore stand-in that writes batches into a database at revision `start` (see write_as_of)."""

    def __init__(self, engine, start: str, monkeypatch: pytest.MonkeyPatch):
        self._engine, self._start, self._monkeypatch = engine, start, monkeypatch

    def write(self, batch):
        write_as_of(self._engine, self._start, batch, self._monkeypatch)
        with self._engine.connect() as conn:
            return audit_store._head(conn)


class _PreChainStore:
    """Writes batches the way loraledger did before revision 0004: adapter rows, no adapter_registered events."""

    def __init__(self, engine, monkeypatch: pytest.MonkeyPatch):
        self._store = _StoreAsOf(engine, "0003_audit_views", monkeypatch)
        insert_adapters = audit_store._insert_adapters
        monkeypatch.setattr(
            audit_store, "_insert_adapters", lambda conn, records: (insert_adapters(conn, records), [])[1]
        )

    def write(self, batch):
        return self._store.write(batch)


def test_0004_brings_the_adapters_of_an_existing_log_into_the_chain(db_url, monkeypatch):
    from loraledger.audit import AuditLog
    from tests.audit.synth import ADAPTERS, build_log
    from tests.audit.tampering import tamper

    assert upgrade(db_url, "0003_audit_views") == "0003_audit_views"
    engine = make_engine(db_url)
    with monkeypatch.context() as patch:
        synth = build_log(_PreChainStore(engine, patch), n_requests=30, days=2, key_ids=False)
    with engine.connect() as conn:
        before = conn.execute(select(EVENTS.c.seq, EVENTS.c.hash).order_by(EVENTS.c.seq)).all()
    assert len(before) == synth.events and not any(k == EventKind.ADAPTER_REGISTERED for k in _kinds(engine))
    stale = _verify_with_later_columns(engine)
    assert not stale.ok and {p.key["fingerprint"] for p in stale.problems} == {a.fingerprint for a in ADAPTERS}
    assert all("loraledger db upgrade" in p.message for p in stale.problems)

    assert upgrade(db_url) == head_revision()
    with engine.connect() as conn:
        after = conn.execute(select(EVENTS).order_by(EVENTS.c.seq)).all()
    assert [(r.seq, r.hash) for r in after[: len(before)]] == before  # the chain as it was is untouched
    added = after[len(before) :]
    assert [r.kind for r in added] == [EventKind.ADAPTER_REGISTERED] * len(ADAPTERS)
    assert {r.payload["adapter"]["fingerprint"] for r in added} == {a.fingerprint for a in ADAPTERS}
    assert all(r.payload["backfilled_by"] == "0004_adapters_in_chain" for r in added)
    with AuditLog(db_url) as log:
        result = log.verify()
    assert result.ok, result.problems
    assert result.head.sequence == synth.events + len(ADAPTERS)
    assert upgrade(db_url) == head_revision()  # again: nothing left to bring in
    assert len(_kinds(engine)) == len(after)
    ensure_schema(engine, db_url)
    engine.dispose()

    # and from now on an edited adapter row is found
    tamper(db_url, "UPDATE adapters SET path = '/adapters/approved' WHERE fingerprint = :f", f=ADAPTERS[1].fingerprint)
    with AuditLog(db_url) as log:
        result = log.verify()
    assert not result.ok and result.first_problem.key == {"fingerprint": ADAPTERS[1].fingerprint}
    assert "in: path" in result.first_problem.message


def _verify_with_later_columns(engine):
    """verify_log on a database at an earlier revision, with the columns later revisions added (NULL) given to it
    in a transaction that is rolled back: today's verify reads today's columns."""
    from loraledger.audit.verify import verify_log

    with engine.connect() as conn:
        trans = conn.begin()
        try:
            created = {table for _, table in ADDED_TABLES}  # made below with every column of today
            for _, table, column in ADDED_COLUMNS:
                if table not in created:
                    conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {column} TEXT")
            for _, table in ADDED_TABLES:
                Base.metadata.tables[table].create(conn)
            from loraledger.evidence.node_store import backfill

            backfill(conn)  # the Merkle tree over the events, as revision 0009 builds it
            return verify_log(conn)
        finally:
            trans.rollback()


def _kinds(engine) -> list[str]:
    with engine.connect() as conn:
        return conn.execute(select(EVENTS.c.kind).order_by(EVENTS.c.seq)).scalars().all()


def test_0007_a_log_from_0005_verifies_and_engine_instances_write_on_after_it(db_url, monkeypatch):
    from loraledger.store.instances import this_instance
    from tests.audit.synth import build_log

    assert upgrade(db_url, "0005_key_id") == "0005_key_id"
    engine = make_engine(db_url)
    before = build_log(_StoreAsOf(engine, "0005_key_id", monkeypatch), n_requests=10, days=1, seed=1, key_ids=False)
    with engine.connect() as conn:
        chain = conn.execute(select(EVENTS.c.seq, EVENTS.c.hash).order_by(EVENTS.c.seq)).all()
    assert upgrade(db_url) == head_revision()
    with engine.connect() as conn:
        assert conn.execute(select(EVENTS.c.seq, EVENTS.c.hash).order_by(EVENTS.c.seq)).all() == chain  # untouched
        assert set(conn.execute(select(REQUESTS.c.instance_id)).scalars()) == {None}
        assert set(conn.execute(select(EVENTS.c.instance_id)).scalars()) == {None}
    engine.dispose()
    with audit_store.AuditStore(db_url) as store:  # an engine of this version joins the old log
        store.register(this_instance("0.1.0", lease_seconds=30))
        build_log(store, n_requests=10, days=1, seed=2)
        with store.engine.connect() as conn:
            owners = set(conn.execute(select(REQUESTS.c.instance_id)).scalars())
    assert owners == {None, store.instance_id}
    with AuditLog(db_url) as log:
        result = log.verify()
    assert result.ok, result.problems
    assert result.requests == len(before.requests) + 10


@pytest.mark.postgres
def test_a_new_database_migrates_under_a_deadline_shorter_than_the_migration_idles(pg_db_url, monkeypatch):
    """The engine's audit_timeout is sized for one group commit; migrating a new database leaves its transaction
    idle between statements (longer on a busy machine), so the migration runs under the open deadline instead."""
    real_upgrade = command.upgrade

    def slow_upgrade(config, revision):
        time.sleep(0.6)  # Python work inside the migration's transaction, past the 0.2 s audit_timeout
        return real_upgrade(config, revision)

    monkeypatch.setattr(command, "upgrade", slow_upgrade)
    with audit_store.AuditStore(pg_db_url, timeout=0.2) as store:
        with store._engine.connect() as conn:
            assert current_revision(conn) == head_revision()
            timeout = conn.execute(text("SHOW idle_in_transaction_session_timeout")).scalar_one()
    assert timeout == "200ms", "the pool's connections keep the engine's own deadline"


def test_0012_brings_the_clean_stops_of_an_existing_log_into_the_chain(db_url):
    """Clean stops written before they went on the chain: verify would call their markers forged; the revision
    appends one instance_stopped event each (marked backfilled), leaving the chain as it was, and verify passes."""
    from loraledger.audit import unvouched
    from loraledger.audit.problems import Problems
    from loraledger.store import instances
    from loraledger.store.instances import this_instance

    assert upgrade(db_url, "0011_receipts_and_checkpoints") == "0011_receipts_and_checkpoints"
    engine = make_engine(db_url)
    stopped, running = this_instance("0.1.0", lease_seconds=30), this_instance("0.1.0", lease_seconds=30)
    for record in (stopped, running):
        with write_transaction(engine) as conn:
            _, event = instances.register(conn, record)
            audit_store.append_events(conn, [event], record.instance_id)
    with write_transaction(engine) as conn:  # a clean stop as it was written before: the lease marker alone
        conn.execute(
            instances.LEASES.update()
            .where(instances.LEASES.c.instance_id == stopped.instance_id)
            .values(recovered_by=stopped.instance_id, recovered_at=func.now())
        )
    with engine.connect() as conn:
        before = conn.execute(select(EVENTS.c.seq, EVENTS.c.hash).order_by(EVENTS.c.seq)).all()
        # verify's check of stop markers (the whole of verify reads the columns later revisions add)
        stale = Problems()
        unvouched.check_stop_markers(conn, stale)
    assert [p.key for p in stale.sorted()] == [{"instance_id": stopped.instance_id}]

    assert upgrade(db_url) == head_revision()
    with engine.connect() as conn:
        after = conn.execute(select(EVENTS).order_by(EVENTS.c.seq)).all()
    assert [(r.seq, r.hash) for r in after[: len(before)]] == before  # the chain as it was is untouched
    added = after[len(before) :]
    assert [(r.kind, r.instance_id) for r in added] == [(EventKind.INSTANCE_STOPPED, stopped.instance_id)]
    assert added[0].payload == {"instance_id": stopped.instance_id, "backfilled_by": "0012_stop_markers_in_chain"}
    with AuditLog(db_url) as log:
        result = log.verify()
    assert result.ok, result.problems
    assert upgrade(db_url) == head_revision()  # again: nothing left to bring in
    assert len(_kinds(engine)) == len(after)
    engine.dispose()
