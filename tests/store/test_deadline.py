"""Deadlines on audit-store operations: a database that hangs is unreachable within the store's timeout.

PostgreSQL is hung through a loopback proxy that freezes the traffic (connections stay open,
nothing answers); SQLite through another connection holding the write lock.
"""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from loraledger.errors import AuditUnavailableError
from loraledger.store.audit_store import AuditStore
from loraledger.store.db import make_engine, write_transaction
from tests.db_fixtures import sample_batch
from tests.tcp_proxy import TcpProxy

TIMEOUT = 1.0
SLACK = 2.0  # scheduling on a loaded 2-core machine; the deadlines themselves are what is measured
PG_CONNECT_FLOOR = 2.0  # libpq waits at least this long for a new connection


def test_sqlite_waits_for_a_held_write_lock_only_as_long_as_its_timeout(tmp_path):
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    holder = make_engine(url)
    with AuditStore(url, timeout=TIMEOUT) as store:
        with write_transaction(holder):  # another writer that holds the lock all along
            started = time.monotonic()
            with pytest.raises(AuditUnavailableError, match="locked") as info:
                store.write(sample_batch(["r1"]))
            waited = time.monotonic() - started
        assert TIMEOUT * 0.9 <= waited < TIMEOUT + SLACK, waited
        assert info.value.maybe_committed is False
        assert store.write(sample_batch(["r1"])).sequence == 3  # the lock is free: it goes through
    holder.dispose()


@pytest.mark.postgres
def test_a_hung_postgres_is_unreachable_within_the_deadline_and_back_after(pg_db_url: str):
    url = make_url(pg_db_url)
    with TcpProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        with AuditStore(proxied, timeout=TIMEOUT) as store:
            with store.engine.connect() as conn:  # the server-side deadlines are the store's too
                assert conn.execute(text("SHOW statement_timeout")).scalar_one() == "1s"
                assert conn.execute(text("SHOW lock_timeout")).scalar_one() == "1s"
            store.write(sample_batch(["before"]))

            proxy.freeze()
            started = time.monotonic()
            with pytest.raises(AuditUnavailableError, match=r"did not answer within 1 s") as info:
                store.write(sample_batch(["during"]))
            pooled = time.monotonic() - started  # the pooled connection hangs: the watchdog cuts it
            assert info.value.maybe_committed is False
            started = time.monotonic()
            with pytest.raises(AuditUnavailableError):
                store.head()
            fresh = time.monotonic() - started  # a new connection: bounded by libpq's connect timeout
            started = time.monotonic()
            with pytest.raises(AuditUnavailableError):
                AuditStore(proxied, timeout=TIMEOUT).open()
            opening = time.monotonic() - started
            print(
                f"hung PostgreSQL: write refused after {pooled:.2f} s, a read after {fresh:.2f} s, open after {opening:.2f} s"
            )
            assert pooled < TIMEOUT + SLACK
            assert fresh < max(TIMEOUT, PG_CONNECT_FLOOR) + SLACK
            assert opening < max(TIMEOUT, PG_CONNECT_FLOOR) + SLACK

            proxy.thaw()
            assert store.write(sample_batch(["after"])).sequence == 5  # 3 before (with the registration), 2 now
            assert store.existing_request_ids(["before", "during", "after"]) == {"before", "after"}
            assert store.first_break() is None
