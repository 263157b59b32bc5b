"""Every column of every audit table is covered by verify: edited behind the guards' back, each is found at its row.

The cases are enumerated from the ORM metadata, so a column added later without coverage fails
here. Each edit runs in a transaction that drops (SQLite) or disables (PostgreSQL) the guards,
verifies on that same connection, and rolls back: one synthetic log per dialect serves every case.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import psycopg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import JSON, Boolean, Connection, Double, Integer, String, Table, select, text, update
from sqlalchemy.types import DateTime

from loraledger.audit.erase import erase
from loraledger.audit.results import VerifyResult
from loraledger.audit.verify import verify_log
from loraledger.evidence import log_tree
from loraledger.evidence.log_key import LogKey
from loraledger.store.audit_store import AuditStore
from loraledger.store.db import make_engine, write_transaction
from loraledger.store.guards import guards_for
from loraledger.store.instances import SOURCE_FIELDS, this_instance
from loraledger.store.migrate import upgrade
from loraledger.store.models import AUDIT_TABLES, COORDINATION_TABLES, Base
from loraledger.store.records import EventKind
from tests.audit.salted import write_salted
from tests.audit.synth import ADAPTERS, DAY, START, SynthLog, build_log
from tests.db_fixtures import _libpq

# the audit tables; instance_leases is coordination state that changes in place (store/instances.py), not a fact on record
TABLES: dict[str, Table] = {name: Base.metadata.tables[name] for name in AUDIT_TABLES}
COLUMNS = [(table.name, col.name) for table in TABLES.values() for col in table.c]
NULLABLE = [(table.name, col.name) for table in TABLES.values() for col in table.c if col.nullable]


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def log_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One migrated database holding a synthetic log, for the whole module."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('columns') / 'audit.sqlite3'}"
        return
    admin = request.getfixturevalue("pg_admin_url")
    name = f"loraledger_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_libpq(admin), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        from sqlalchemy.engine import make_url

        yield make_url(admin).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(_libpq(admin), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def log(log_url: str) -> tuple[str, SynthLog]:
    upgrade(log_url)
    with AuditStore(log_url) as store:
        # written by a registered engine instance: its row, and its id on every requests row and event
        instance = this_instance("0.1.0", lease_seconds=60)
        sources = {name: f"org/{name}" if "commit" not in name else "c" * 40 for name in SOURCE_FIELDS}
        sources.update(quant_bits=4, quant_group_size=128, quant_source_fingerprint="d" * 64)  # typed columns
        store.register(msgspec.structs.replace(instance, **sources))
        store.log_key = LogKey(Ed25519PrivateKey.generate(), "test.example/log")  # receipts for finished requests
        synth = build_log(store, n_requests=40, days=3, seed=5)
        # then, as from revision 0013, requests with salted text; one of them erased
        write_salted(store, SALTED, at=START + 4 * DAY, tenant="acme", adapter=ADAPTERS[2])
        with write_transaction(store.engine) as conn:
            erase(conn, request_id=SALTED[0], reason="the data subject asked")
        synth.events = store.head().sequence
        with store.engine.begin() as conn:
            log_tree.sign_checkpoint(conn, store.log_key)
    return log_url, synth


@pytest.fixture(scope="module")
def engine(log: tuple[str, SynthLog]) -> Iterator[Any]:
    engine = make_engine(log[0])
    yield engine
    engine.dispose()


@contextlib.contextmanager
def unguarded(engine: Any) -> Iterator[Connection]:
    """A transaction with every guard out of the way, rolled back afterwards: what an intruder with the
    database's owner rights can do, without spoiling the log for the next case."""
    with engine.connect() as conn:
        trans = conn.begin()
        try:
            if conn.dialect.name == "sqlite":
                conn.exec_driver_sql("PRAGMA defer_foreign_keys = ON")  # checked at commit, which never comes
                for guard in guards_for("sqlite"):
                    conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {guard.name}")
            else:
                for table in AUDIT_TABLES:  # ALL: the foreign keys' triggers too
                    conn.exec_driver_sql(f"ALTER TABLE {table} DISABLE TRIGGER ALL")
            yield conn
        finally:
            trans.rollback()


# -- the row each table's cases edit ----------------------------------------------------------


def _targets(synth: SynthLog) -> dict[str, dict[str, Any]]:
    """The primary key of the row edited in each table: rows whose every column holds a value."""
    request = next(
        r for r in synth.requests
        if r.outcome == "stop" and len(r.completions) >= 2 and r.binding.tenant and r.binding.adapter_fingerprint
    )  # fmt: skip
    return {
        "instances": {"host": socket.gethostname()},
        "adapters": {"fingerprint": ADAPTERS[2].fingerprint},
        "requests": {"request_id": request.binding.request_id},
        "completions": {"request_id": request.binding.request_id, "completion_index": 0},
        "events": {"request_id": request.binding.request_id, "kind": EventKind.REQUEST_FINISHED},
        "merkle_nodes": {"level": 1, "idx": 3},
        "checkpoints": {"tree_size": synth.events},
        "receipts": {"request_id": request.binding.request_id},
        "request_texts": {"request_id": SALTED[1], "part": "completion", "idx": 1},
        "erasures": {"request_id": SALTED[0]},
    }


# the columns only a request written with salted text fills (its prompt_text, and its completions' text, are empty)
SALTED_COLUMNS = {"prompt_commitment", "prompt_token_ids_commitment", "text_commitment", "token_ids_commitment",
                  "tools_commitment", "constraint_commitment", "tool_reading", "tool_calls_commitment"}  # fmt: skip
SALTED = ["salted-0", "salted-1"]


def _target(synth: SynthLog, table: str, column: str) -> dict[str, Any]:
    if column in SALTED_COLUMNS:
        return {"request_id": SALTED[1]} if table == "requests" else {"request_id": SALTED[1], "completion_index": 0}
    return _targets(synth)[table]


def _row(conn: Connection, table: Table, where: dict[str, Any]) -> Any:
    return conn.execute(select(table).where(*(table.c[k] == v for k, v in where.items()))).one()


def _other_value(column: Any, value: Any) -> Any:
    """A value of column's type that differs from value (value may be None)."""
    kind = column.type
    if isinstance(kind, JSON):
        if isinstance(value, list):
            return [*value, value[-1] if value else 1]
        if isinstance(value, dict):
            return {**value, "forged": True}
        return {"forged": True}
    if isinstance(kind, Boolean):
        return not value
    if isinstance(kind, Integer):
        return 1 if value is None else value + 1000
    if isinstance(kind, Double):
        return 0.5 if value is None else value + 0.5
    if isinstance(getattr(kind, "impl", kind), DateTime):
        base = value or dt.datetime(2026, 11, 23, tzinfo=dt.timezone.utc)
        return base + dt.timedelta(seconds=1)
    if isinstance(kind, String):
        width = getattr(kind, "length", None)
        if width in (40, 64):  # a commit sha or a sha256, in hex
            return "e" * width if value != "e" * width else "d" * width
        return "forged" if value is None else value + "-forged"
    raise AssertionError(f"no edit known for {column.table.name}.{column.name} ({kind!r}): teach this test its type")


def _keys(table: str, row: Any, column: str, new: Any) -> list[dict[str, Any]]:
    """The keys a problem may name for the edited row (the key before or after the edit)."""
    pk = [c.name for c in TABLES[table].primary_key.columns]
    before = {k: getattr(row, k) for k in pk}
    keys = [before]
    if column in pk:
        keys.append({**before, column: new})
    return keys


def _names_row(result: VerifyResult, table: str, keys: list[dict[str, Any]]) -> bool:
    """Some problem names table and the row's key (or, for completions, the request all its rows share)."""
    for problem in result.problems:
        named = problem.key or {}
        if (
            problem.table == table
            and named
            and any(all(k in key and key[k] == v for k, v in named.items()) for key in keys)
        ):
            return True
    return False


def _edit_and_verify(
    engine: Any, synth: SynthLog, table: str, column: str, *, to_null: bool
) -> tuple[VerifyResult, list]:
    t = TABLES[table]
    with unguarded(engine) as conn:
        where = _target(synth, table, column)
        row = _row(conn, t, where)
        old = getattr(row, column)
        new = None if to_null else _other_value(t.c[column], old)
        assert new != old, f"{table}.{column}: the edit would change nothing"
        pk = {c.name: getattr(row, c.name) for c in t.primary_key.columns}
        changed = conn.execute(update(t).where(*(t.c[k] == v for k, v in pk.items())).values({column: new})).rowcount
        assert changed == 1
        result = verify_log(conn)
    return result, _keys(table, row, column, new)


@pytest.mark.parametrize(("table", "column"), COLUMNS, ids=[f"{t}.{c}" for t, c in COLUMNS])
def test_an_edited_column_fails_verify_and_names_its_row(engine, log, table: str, column: str):
    url, synth = log
    result, keys = _edit_and_verify(engine, synth, table, column, to_null=False)
    assert not result.ok, f"editing {table}.{column} went unnoticed"
    assert _names_row(result, table, keys), f"{table}.{column}: no problem names the row {keys}: {result.problems}"


@pytest.mark.parametrize(("table", "column"), NULLABLE, ids=[f"{t}.{c}" for t, c in NULLABLE])
def test_a_value_set_to_null_fails_verify_and_names_its_row(engine, log, table: str, column: str):
    url, synth = log
    result, keys = _edit_and_verify(engine, synth, table, column, to_null=True)
    assert not result.ok, f"setting {table}.{column} to NULL went unnoticed"
    assert _names_row(result, table, keys), f"{table}.{column}: no problem names the row {keys}: {result.problems}"


def test_every_table_is_enumerated_and_the_views_read_only_them(engine):
    assert set(Base.metadata.tables) == set(AUDIT_TABLES) | set(COORDINATION_TABLES)
    with engine.connect() as conn:
        if conn.dialect.name == "sqlite":
            views = dict(conn.execute(text("SELECT name, sql FROM sqlite_master WHERE type = 'view'")).all())
        else:
            views = dict(
                conn.execute(text("SELECT viewname, definition FROM pg_views WHERE schemaname = 'public'")).all()
            )
    assert set(views) == {"adapter_usage", "request_lineage"}
    for name, sql in views.items():
        sources = {m.lower() for m in re.findall(r"\b(?:FROM|JOIN)\s+(?:public\.)?\(?(\w+)", sql, flags=re.IGNORECASE)}
        sources -= {"select"}  # FROM (SELECT ...) subqueries
        assert sources and sources <= set(AUDIT_TABLES), f"view {name} reads {sources}"


def test_swapping_two_adapters_names_fails_verify(engine, log):
    url, _ = log
    a, b = ADAPTERS[0], ADAPTERS[1]
    t = TABLES["adapters"]
    with unguarded(engine) as conn:
        conn.execute(update(t).where(t.c.fingerprint == a.fingerprint).values(name=b.name))
        conn.execute(update(t).where(t.c.fingerprint == b.fingerprint).values(name=a.name))
        result = verify_log(conn)
    assert not result.ok
    named = {p.key["fingerprint"] for p in result.problems if p.table == "adapters" and "in: name" in p.message}
    assert named == {a.fingerprint, b.fingerprint}, result.problems


def test_the_clean_log_verifies(engine, log):
    with engine.connect() as conn:
        result = verify_log(conn)
    assert result.ok, result.problems
    with unguarded(engine) as conn:
        result = verify_log(conn)
    # the cases below edit rows with the guards out of the way: verify says so, and finds nothing else
    assert result.problems and {p.table for p in result.problems} == {"triggers"}, result.problems
