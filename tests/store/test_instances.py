"""Engine instances sharing one audit database: registration on the chain, leases by the database's clock, recovery
only of instances that are gone, claimed once however many engines try, and no writes from an instance once recovered."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import pytest
from sqlalchemy import select

from loraledger.errors import ConfigError, InstanceLeaseLostError
from loraledger.store import process_identity
from loraledger.store.audit_store import EVENTS, AuditStore
from loraledger.store.instances import this_instance
from loraledger.store.records import EventKind
from tests.db_fixtures import sample_batch

ELSEWHERE = "another-machine/pid:[1]/4242/99"  # a process key no process here matches: only the lease can tell


@pytest.fixture
def elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Instances registered under it look like engines on another machine."""
    monkeypatch.setattr(process_identity, "process_key", lambda: ELSEWHERE)


def _engine_store(url: str, lease: float = 30.0) -> AuditStore:
    store = AuditStore(url, timeout=5.0).open()
    store.register(this_instance("0.1.0", lease))
    return store


def _interrupted(store: AuditStore) -> Counter[str]:
    with store.engine.connect() as conn:
        query = select(EVENTS.c.request_id, EVENTS.c.instance_id).where(EVENTS.c.kind == EventKind.REQUEST_INTERRUPTED)
        return Counter(f"{rid}@{iid}" for rid, iid in conn.execute(query))


def test_a_live_peer_is_left_alone_and_an_expired_one_is_recovered_once(migrated_db_url, elsewhere):
    peer = _engine_store(migrated_db_url, lease=1.0)
    peer.write(sample_batch(["p-done"]))
    peer.write(sample_batch(["p-open-1", "p-open-2"], finished=False))
    me = _engine_store(migrated_db_url)
    try:
        assert me.recover_expired().requests == []  # the peer's lease runs: its requests are in flight, not interrupted
        assert me.recover_expired(at_start=False).instances == []
        peer.renew_lease()
        time.sleep(1.2)  # the peer stops renewing (stalled, or its machine gone)
        recovery = me.recover_expired(at_start=False)
        assert recovery.instances == [peer.instance_id]
        assert sorted(r.request_id for r in recovery.requests) == ["p-open-1", "p-open-2"]
        assert _interrupted(me) == Counter({f"p-open-1@{me.instance_id}": 1, f"p-open-2@{me.instance_id}": 1})
        assert me.recover_expired(at_start=False).instances == []  # claimed once
        # the stalled peer wakes up: it may not renew, nor put anything on record for the requests now interrupted
        with pytest.raises(InstanceLeaseLostError, match=f"lost its lease.*{me.instance_id} recovered it"):
            peer.renew_lease()
        with pytest.raises(InstanceLeaseLostError, match="writes nothing more"):
            peer.write(sample_batch(["p-open-1"]))
        states = {s.instance.instance_id: s.state for s in me.lease_states()}
        assert states == {peer.instance_id: "recovered", me.instance_id: "live"}
        assert me.first_break() is None
    finally:
        peer.close()
        me.close()


def test_two_replacements_racing_for_one_dead_instance_record_it_once(migrated_db_url, elsewhere):
    dead = _engine_store(migrated_db_url, lease=1.0)
    dead.write(sample_batch([f"d-{i}" for i in range(6)], finished=False))
    dead.close()
    time.sleep(1.1)
    racers = [_engine_store(migrated_db_url) for _ in range(3)]
    barrier = threading.Barrier(len(racers))
    results: dict[str, list[str]] = {}

    def race(store: AuditStore) -> None:
        barrier.wait()
        results[store.instance_id] = [r.request_id for r in store.recover_expired(at_start=False).requests]

    threads = [threading.Thread(target=race, args=(store,)) for store in racers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        winners = [iid for iid, rids in results.items() if rids]
        assert len(results) == 3 and len(winners) == 1
        assert sorted(results[winners[0]]) == [f"d-{i}" for i in range(6)]
        assert _interrupted(racers[0]) == Counter({f"d-{i}@{winners[0]}": 1 for i in range(6)})
    finally:
        for store in racers:
            store.close()


def test_a_clean_stop_ends_the_lease_and_one_with_requests_left_hands_them_over_at_once(migrated_db_url, elsewhere):
    clean, unclean = _engine_store(migrated_db_url), _engine_store(migrated_db_url)
    clean.write(sample_batch(["c-1"]))
    unclean.write(sample_batch(["u-1"], finished=False))
    clean.release_lease()
    unclean.release_lease()  # its store could not commit u-1's end before the stop: a peer takes it over now
    me = _engine_store(migrated_db_url)
    try:
        recovery = me.recover_expired(at_start=False)
        assert recovery.instances == [unclean.instance_id] and [r.request_id for r in recovery.requests] == ["u-1"]
        states = {s.instance.instance_id: s.state for s in me.lease_states()}
        assert states[clean.instance_id] == "stopped" and states[unclean.instance_id] == "recovered"
    finally:
        for store in (clean, unclean, me):
            store.close()


def test_an_engine_restarted_where_its_predecessor_died_recovers_it_without_waiting_for_the_lease(migrated_db_url):
    crashed = _engine_store(migrated_db_url, lease=3600)  # this process, this machine
    crashed.write(sample_batch(["x-1"], finished=False))
    other = _engine_store(migrated_db_url, lease=3600)  # still running in this process: not gone
    crashed.close()  # its engine no longer runs here, and it never released its lease
    me = _engine_store(migrated_db_url)
    try:
        recovery = me.recover_expired()
        assert recovery.instances == [crashed.instance_id] and [r.request_id for r in recovery.requests] == ["x-1"]
    finally:
        other.close()
        me.close()


def test_process_keys_tell_gone_processes_only_on_their_own_machine():
    key = process_identity.process_key()
    if key is None:
        pytest.skip("no /proc here: only leases decide")
    process_identity.mark_running("here", True)
    assert not process_identity.certainly_gone("here", key)
    process_identity.mark_running("here", False)
    assert process_identity.certainly_gone("here", key)
    machine = key.rsplit("/", 2)[0]
    assert process_identity.certainly_gone("dead", f"{machine}/{2**22 + 12345}/1")  # no such pid
    assert not process_identity.certainly_gone(
        "parent", f"{machine}/{os.getppid()}/{process_identity._start_ticks(os.getppid())}"
    )
    assert not process_identity.certainly_gone("far", ELSEWHERE) and not process_identity.certainly_gone("none", None)


def test_the_lease_must_outlast_a_renewal():
    from loraledger import EngineArgs

    with pytest.raises(ConfigError, match="audit_lease_seconds must be .* greater than audit_timeout"):
        EngineArgs(model="m", audit_timeout=5.0, audit_lease_seconds=5.0)
    assert EngineArgs(model="m").audit_lease_seconds == 30.0
