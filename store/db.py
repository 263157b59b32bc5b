"""Database URLs and engines: SQLite (WAL, synchronous=FULL) by default, PostgreSQL via psycopg 3.

DESIGN: several engines, one chain. Every engine sharing an audit database appends to one chain,
its appends serialized by the database: each group commit runs in `write_transaction`, which
takes PostgreSQL's transaction-scoped advisory lock (SQLite: BEGIN IMMEDIATE, the file's write
lock), reads the head, chains its events on and commits before the next writer can read the head.
So sequence numbers stay gap-free and every prev_hash is the hash of the event before it, whatever
the number of writers; each event names the instance that wrote it (`instance_id`, hashed), so a
per-instance view is a filter over the one chain, not a second structure to reconcile.
The alternative, a chain per instance with a signed head over all, would let writers append in
parallel, but verify would need every instance's head and a key to trust, and "the log" would stop
being one sequence an auditor can read in order. The price of serializing is one lock hand-over per
group commit, which the group commit shares among every record in it, and the lock is held only for
the chain's part of it on PostgreSQL: a writer inserts its own requests and completions rows first
and takes the lock just before it reads the head (a batch registering an adapter takes it first,
since two instances may register one adapter at once). `python -m bench.run --only audit-chain`
measures events/s with 1 and 4 writer processes (bench/RESULTS.md, "Several writers, one chain").
The chain's hashes themselves are defined in loraledger/digests.py (spec: DIGESTS.md).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url

from loraledger.errors import AuditUnavailableError, ConfigError
from loraledger.paths import default_audit_url  # noqa: F401  (the store's default: a SQLite file under data_dir())

SQLITE_BUSY_TIMEOUT_MS = 30_000  # readers and tools; an engine's store waits at most its audit_timeout
PG_CONNECT_TIMEOUT_S = 10
# one advisory lock key for every loraledger writer and migrator of a database
WRITER_LOCK_KEY = zlib.crc32(b"loraledger.audit.writer")


def normalize_url(url: str | URL) -> URL:
    """url with PostgreSQL pointed at psycopg 3 (`postgresql://` and `postgres://` are accepted)."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def display_url(url: str | URL) -> str:
    """url for messages: the password masked."""
    return normalize_url(url).render_as_string(hide_password=True)


def make_engine(url: str | URL, *, timeout: float | None = None) -> Engine:
    """An Engine for url. SQLite: WAL, synchronous=FULL, foreign keys on, a busy timeout, and
    SQLAlchemy (not the sqlite3 module) emitting BEGIN, so that DDL is transactional and a
    connection can ask for BEGIN IMMEDIATE with the `sqlite_begin` execution option.

    timeout (seconds): the server-side deadlines of the engine's store, as its audit_timeout sets
    them. SQLite: the busy timeout. PostgreSQL: statement_timeout, lock_timeout (the writers' lock
    included) and idle_in_transaction_session_timeout, TCP keepalives and tcp_user_timeout (a dead
    peer is noticed), and the connect timeout. None: the defaults of readers and tools (a 30 s busy
    timeout, a 10 s connect timeout, no statement deadline: a verify of a large log takes its time).
    The client-side deadline (store/deadline.py) covers what the server cannot: a hung peer."""
    parsed = normalize_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        busy_ms = SQLITE_BUSY_TIMEOUT_MS if timeout is None else max(1, round(timeout * 1000))
        return _sqlite_engine(parsed, busy_ms)
    if backend != "postgresql":
        raise ConfigError(
            f"audit database URL {display_url(parsed)}: the audit store runs on SQLite (sqlite:///path) "
            f"or PostgreSQL (postgresql://...), not {backend}"
        )
    # pre-ping: after a database restart the pool hands out a live connection instead of a dead one
    return create_engine(parsed, pool_pre_ping=True, connect_args=pg_connect_args(parsed, timeout))


def pg_connect_args(url: URL, timeout: float | None) -> dict[str, Any]:
    """libpq parameters for a store with deadline timeout (None: only the connect timeout)."""
    if timeout is None:
        return {"connect_timeout": PG_CONNECT_TIMEOUT_S}
    ms = max(1, round(timeout * 1000))
    settings = f"-c statement_timeout={ms} -c lock_timeout={ms} -c idle_in_transaction_session_timeout={ms}"
    given = url.query.get("options")
    if given:  # the URL's own options stay, ours come after them
        settings = f"{given if isinstance(given, str) else ' '.join(given)} {settings}"
    return {
        "connect_timeout": pg_connect_timeout(timeout),
        "options": settings,
        "keepalives": 1,
        "keepalives_idle": max(1, math.ceil(timeout)),
        "keepalives_interval": 1,
        "keepalives_count": 3,
        "tcp_user_timeout": ms,
    }


def pg_connect_timeout(timeout: float | None) -> int:
    """libpq's connect_timeout for a deadline: whole seconds, at least 2 (libpq's own floor)."""
    return PG_CONNECT_TIMEOUT_S if timeout is None else max(2, math.ceil(timeout))


def _sqlite_engine(url: URL, busy_timeout_ms: int) -> Engine:
    database = url.database
    if database and database != ":memory:" and not database.startswith("file:"):
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    # the audit writer may run in a worker thread; the pool hands connections between threads
    engine = create_engine(url, connect_args={"check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # sqlite3 must not emit its own BEGIN
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {busy_timeout_ms}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = FULL")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")

    return engine


@contextlib.contextmanager
def write_transaction(engine: Engine, *, lock: bool = True) -> Iterator[Connection]:
    """A transaction holding the database's single-writer lock; commits on exit, rolls back on error.

    SQLite: BEGIN IMMEDIATE takes the write lock up front (a deferred transaction that reads
    first can fail to upgrade). PostgreSQL: a transaction-scoped advisory lock, so concurrent
    writers append to the event chain one after another. lock=False (PostgreSQL): the caller takes
    it later with take_writer_lock, so that what needs no turn is written before the wait.
    """
    with engine.connect() as conn:
        conn.execution_options(sqlite_begin="IMMEDIATE")
        with conn.begin():
            if lock:
                take_writer_lock(conn)
            yield conn


def take_writer_lock(conn: Connection) -> None:
    """Hold the single-writer lock until conn's transaction ends (PostgreSQL; taking it again is harmless; SQLite's
    write_transaction already holds the file's write lock)."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": WRITER_LOCK_KEY})


@contextlib.contextmanager
def unavailable_as_error(url: str | URL) -> Iterator[None]:
    """Turn a failure to reach or use the database into AuditUnavailableError naming the URL."""
    try:
        yield
    except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError, sa_exc.TimeoutError) as exc:
        reason = getattr(exc, "orig", None) or exc
        raise AuditUnavailableError(
            f"the audit store at {display_url(url)} is unreachable: {str(reason).strip()}"
        ) from exc
    except sa_exc.DBAPIError as exc:
        if not exc.connection_invalidated:
            raise
        raise AuditUnavailableError(
            f"the audit store at {display_url(url)} is unreachable: the connection was lost ({str(exc.orig).strip()})"
        ) from exc
    except OSError as exc:  # e.g. the SQLite file's folder cannot be created
        raise AuditUnavailableError(f"the audit store at {display_url(url)} is unreachable: {exc}") from exc
