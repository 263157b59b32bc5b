"""A clean stop's lease marker is vouched for by an instance_stopped event: verify finds the marker erased or
altered (the instance would look crashed), and a marker forged on a crashed instance (its unfinished requests
hidden from recovery); on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import text, update

from loraledger.audit import AuditLog
from loraledger.store.audit_store import AuditStore
from loraledger.store.db import make_engine
from loraledger.store.instances import LEASES, this_instance
from loraledger.store.records import EventKind
from tests.audit.synth import build_log


def _instances(url: str) -> tuple[str, str]:
    """Two instances: the first stopped cleanly (it left nothing unfinished), the second wrote a log and runs."""
    ids = []
    for seed in (1, 2):
        store = AuditStore(url).open()
        try:
            ids.append(store.register(this_instance("0.1.0", lease_seconds=600)).instance_id)
            if seed == 1:
                store.release_lease()
            else:
                build_log(store, n_requests=6, days=1, seed=seed)
        finally:
            store.close()
    return ids[0], ids[1]


def _problems(url: str) -> list[str]:
    with AuditLog(url) as log:
        return [p.message for p in log.verify().problems]


def _set_lease(url: str, instance_id: str, **values) -> None:
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            assert (
                conn.execute(update(LEASES).where(LEASES.c.instance_id == instance_id).values(**values)).rowcount == 1
            )
    finally:
        engine.dispose()


def test_a_clean_stop_is_on_the_chain_and_verifies(migrated_db_url: str):
    stopped, _ = _instances(migrated_db_url)
    assert _problems(migrated_db_url) == []
    engine = make_engine(migrated_db_url)
    try:
        with engine.connect() as conn:
            kinds = conn.execute(
                text("SELECT instance_id FROM events WHERE kind = :k"), {"k": EventKind.INSTANCE_STOPPED}
            ).scalars()
            assert list(kinds) == [stopped]
    finally:
        engine.dispose()


@pytest.mark.parametrize("erase", ["cleared", "another recoverer"])
def test_an_erased_stop_marker_fails_verify(migrated_db_url: str, erase: str):
    stopped, running = _instances(migrated_db_url)
    recoverer = None if erase == "cleared" else running
    _set_lease(migrated_db_url, stopped, recovered_by=recoverer, recovered_at=None)
    problems = _problems(migrated_db_url)
    assert any(f"instance {stopped} stopped cleanly" in p and "marker was erased" in p for p in problems), problems


def test_a_deleted_lease_row_fails_verify(migrated_db_url: str):
    stopped, _ = _instances(migrated_db_url)
    engine = make_engine(migrated_db_url)
    try:
        with engine.begin() as conn:
            conn.execute(LEASES.delete().where(LEASES.c.instance_id == stopped))
    finally:
        engine.dispose()
    assert any(f"instance {stopped} stopped cleanly" in p for p in _problems(migrated_db_url))


def test_a_forged_stop_marker_fails_verify(migrated_db_url: str):
    _, running = _instances(migrated_db_url)
    _set_lease(migrated_db_url, running, recovered_by=running)
    problems = _problems(migrated_db_url)
    assert any(f"lease of instance {running}" in p and "no instance_stopped event" in p for p in problems), problems
