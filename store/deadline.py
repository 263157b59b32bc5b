"""Client-side deadlines on audit-store work: past its deadline an operation's connections are cut, so it fails as unreachable.

Server-side timeouts (PostgreSQL's statement_timeout, SQLite's busy timeout) cannot help when the
server, or the network to it, hangs with the connection open and no answer coming: the client
waits on a socket that never becomes readable. The watchdog is the client's own clock. When an
operation runs past its deadline it shuts down the socket of every PostgreSQL connection the
engine holds (libpq then fails at once, wherever it waits) or interrupts every SQLite connection,
and keeps doing so until the operation gives up; a connection attempt started after the deadline
fails before it is made, and one made before it is bounded by what is left of it (PostgreSQL's
`connect_timeout`, which libpq rounds up to at least 2 s).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Engine, event

RECUT_S = 0.05  # while an expired operation still runs, its connections are cut again this often
PG_MIN_CONNECT_TIMEOUT_S = 2  # libpq's (and psycopg's) floor


class Operation:
    """One piece of store work under a deadline; `expired` turns True when the watchdog steps in."""

    __slots__ = ("ends", "expired", "seconds")

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.ends = time.monotonic() + seconds
        self.expired = False

    def remaining(self) -> float:
        return self.ends - time.monotonic()


class Watchdog:
    """Deadlines for the operations run on one Engine (attach it before the engine's first connection)."""

    def __init__(self, engine: Engine, *, connect_timeout: int):
        self._dialect = engine.dialect.name
        self._connect_timeout = connect_timeout
        self._cond = threading.Condition()
        self._conns: dict[int, Any] = {}  # id -> DBAPI connection, every one the pool holds open
        self._ops: set[Operation] = set()
        self._local = threading.local()  # the operation the current thread runs
        self._thread: threading.Thread | None = None
        self._wake_at = 0.0  # when the watching thread wakes next (monotonic); it re-plans from the operations left
        self._closed = False
        event.listen(engine, "do_connect", self._before_connect)
        event.listen(engine, "connect", self._on_connect)
        event.listen(engine, "close", self._on_close)
        event.listen(engine, "close_detached", self._on_close_detached)

    @contextlib.contextmanager
    def deadline(self, seconds: float | None) -> Iterator[Operation | None]:
        """Run the body under a deadline of seconds (None: none); yields the Operation, whose
        `expired` says afterwards whether the watchdog cut its connections."""
        if seconds is None:
            yield None
            return
        op = Operation(seconds)
        outer = getattr(self._local, "op", None)
        self._local.op = op
        with self._cond:
            self._ops.add(op)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._watch, name="loraledger-db-watchdog", daemon=True)
                self._thread.start()
            if op.ends < self._wake_at:  # the watching thread would sleep past this deadline: wake it
                self._cond.notify()
        try:
            yield op
        finally:
            with self._cond:
                self._ops.discard(op)
                if self._closed:  # the watching thread ends once no operation is left
                    self._cond.notify()
            self._local.op = outer

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    # -- the watching thread ---------------------------------------------------------------

    def _watch(self) -> None:
        with self._cond:
            while not (self._closed and not self._ops):  # an operation still running keeps its deadline
                now = time.monotonic()
                for op in self._ops:
                    if op.ends <= now:
                        op.expired = True
                if any(op.expired for op in self._ops):
                    for conn in list(self._conns.values()):
                        self._cut(conn)
                    self._wake_at = now + RECUT_S
                    self._cond.wait(RECUT_S)
                    continue
                # a finished operation's deadline may still be the one slept to: waking then is harmless and
                # spares a wake-up per operation (the common case: one short operation after another)
                self._wake_at = min((op.ends for op in self._ops), default=math.inf)
                self._cond.wait(None if self._wake_at == math.inf else max(0.0, self._wake_at - now))

    def _cut(self, conn: Any) -> None:
        """Make every wait on conn fail now (called with the lock held: the pool cannot close it meanwhile)."""
        try:
            if self._dialect == "sqlite":
                conn.interrupt()
                return
            if conn.closed:
                return
            # shutdown acts on the socket, not on the descriptor: a duplicate reaches libpq's socket
            with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except Exception:  # noqa: BLE001  already closed or broken: nothing left to cut
            pass

    # -- pool events -----------------------------------------------------------------------

    def _before_connect(self, dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
        op: Operation | None = getattr(self._local, "op", None)
        timeout = self._connect_timeout
        if op is not None:
            left = op.remaining()
            if op.expired or left <= 0:
                raise dialect.loaded_dbapi.OperationalError(f"no answer within the {op.seconds:g} s deadline")
            timeout = min(timeout, max(PG_MIN_CONNECT_TIMEOUT_S, math.ceil(left)))
        if self._dialect == "postgresql":
            cparams["connect_timeout"] = timeout  # cparams persists between connections: set every time

    def _on_connect(self, dbapi_connection: Any, _record: Any) -> None:
        with self._cond:
            self._conns[id(dbapi_connection)] = dbapi_connection

    def _on_close(self, dbapi_connection: Any, _record: Any) -> None:
        with self._cond:
            self._conns.pop(id(dbapi_connection), None)

    def _on_close_detached(self, dbapi_connection: Any) -> None:
        self._on_close(dbapi_connection, None)
