"""verify: a clean log passes; tampering by someone who drops the guards is found at the first bad sequence number."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from loraledger.audit import AuditLog
from loraledger.audit.verify import read_checkpoint, write_checkpoint
from loraledger.digests import EventFields, event_hash
from loraledger.errors import ConfigError
from loraledger.store.audit_store import AuditStore
from loraledger.store.db import make_engine
from tests.audit.synth import SynthLog
from tests.audit.tampering import drop_guards, event_seq, rebuild_tree, tamper


def test_a_clean_log_verifies_and_names_its_head(migrated_db_url: str, synth: SynthLog):
    with AuditStore(migrated_db_url) as store:
        head = store.head()
    with AuditLog(migrated_db_url) as log:
        result = log.verify()
        assert result.ok and result.problems == [] and result.problem_count == 0
        assert result.head == head == log.head()
        assert result.events == synth.events == head.sequence
        assert result.requests == len(synth.requests)
        assert result.completions == sum(len(r.completions) for r in synth.requests)
        assert log.verify(head).ok


def test_an_empty_log_verifies(migrated_db_url: str):
    with AuditLog(migrated_db_url) as log:
        result = log.verify()
    assert result.ok and result.head is None and result.events == 0


def _finished(synth: SynthLog) -> str:
    return next(
        r.binding.request_id for r in synth.requests if len(r.completions) > 1 and r.outcome in ("stop", "length")
    )


@pytest.mark.parametrize(
    "case",
    [
        "event_kind",
        "event_payload",
        "binding_row",
        "completion_text",
        "completion_deleted",
        "aborted_completion",
        "middle_event_deleted",
    ],  # fmt: skip
)
def test_tampering_is_found_at_the_first_bad_sequence(migrated_db_url: str, synth: SynthLog, case: str):
    url = migrated_db_url
    rid = _finished(synth)
    admitted, finished = event_seq(url, rid, "request_admitted"), event_seq(url, rid, "request_finished")
    middle = synth.events // 2
    if case == "event_kind":
        tamper(url, "UPDATE events SET kind = 'request_aborted' WHERE seq = :s", s=finished)
        bad, why = finished, "does not match its contents"
    elif case == "event_payload":
        tamper(url, "UPDATE events SET request_id = 'someone-else' WHERE seq = :s", s=admitted)
        bad, why = admitted, "does not match its contents"
    elif case == "binding_row":
        tamper(url, "UPDATE requests SET tenant = 'mallory' WHERE request_id = :r", r=rid)
        bad, why = admitted, "differs from its admitted binding in: tenant"
    elif case == "completion_text":
        tamper(url, "UPDATE completions SET text = 'forged' WHERE request_id = :r AND completion_index = 1", r=rid)
        bad, why = finished, "do not match the request_finished event's completions_sha256"
    elif case == "completion_deleted":
        tamper(url, "DELETE FROM completions WHERE request_id = :r AND completion_index = 1", r=rid)
        bad, why = finished, "completions but"
    elif case == "aborted_completion":
        aborted = next(r.binding.request_id for r in synth.requests if r.outcome == "abort")
        tamper(url, "UPDATE completions SET generated_token_count = 999 WHERE request_id = :r", r=aborted)
        bad, why = event_seq(url, aborted, "request_aborted"), "request_aborted event's completions_sha256"
    else:
        tamper(url, "DELETE FROM events WHERE seq = :s", s=middle)
        bad, why = middle, f"event seq {middle} is missing"
    with AuditLog(url) as log:
        result = log.verify()
    assert not result.ok
    assert result.first_problem is not None
    assert result.first_problem.sequence == bad, result.problems
    assert why in result.first_problem.message


def test_a_cut_tail_is_found_against_a_checkpoint(migrated_db_url: str, synth: SynthLog, tmp_path):
    url = migrated_db_url
    with AuditLog(url) as log:
        head = log.head()
    assert head is not None
    write_checkpoint(tmp_path / "cp.json", head)
    assert read_checkpoint(tmp_path / "cp.json") == head
    keep = head.sequence - 3
    # a careful intruder removes the rows the cut events vouched for too
    gone = "SELECT request_id FROM events WHERE seq > :s AND kind = 'request_admitted'"
    ended = "SELECT request_id FROM events WHERE seq > :s AND kind IN ('request_finished', 'request_aborted')"
    tamper(
        url,
        f"DELETE FROM completions WHERE request_id IN ({gone}) OR request_id IN ({ended})",
        f"DELETE FROM requests WHERE request_id IN ({gone})",
        "DELETE FROM events WHERE seq > :s",
        s=keep,
    )
    rebuild_tree(url)
    with AuditLog(url) as log:
        shorter = log.verify()
        assert shorter.ok, shorter.problems  # a shorter log is still consistent: only the checkpoint can tell
        result = log.verify(tmp_path / "cp.json")
    assert not result.ok
    assert result.first_problem.sequence == keep + 1
    assert f"the log ends at seq {keep} but the checkpoint is at seq {head.sequence}" in result.first_problem.message


def test_a_rewritten_chain_is_found_against_a_checkpoint(migrated_db_url: str, synth: SynthLog):
    """An intruder who alters an event and recomputes every later hash passes the chain check, not the checkpoint."""
    url = migrated_db_url
    with AuditLog(url) as log:
        head = log.head()
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            # an adapter_loaded event: no row depends on it
            target = conn.execute(text("SELECT min(seq) FROM events WHERE kind = 'adapter_loaded'")).scalar_one()
            rows = (
                conn.execute(text("SELECT seq FROM events WHERE seq >= :s ORDER BY seq"), {"s": target}).scalars().all()
            )
    finally:
        engine.dispose()
    tamper(url, "UPDATE events SET kind = 'adapter_evicted' WHERE seq = :s", s=target)
    _rehash(url, rows)
    rebuild_tree(url)
    with AuditLog(url) as log:
        assert log.verify().ok
        result = log.verify(head)
    assert not result.ok
    assert result.first_problem.sequence == head.sequence
    assert "differs from the checkpoint" in result.first_problem.message


def _rehash(url: str, seqs: list[int]) -> None:
    from loraledger.store.models import Event

    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            table = Event.__table__
            drop_guards(conn)  # rebuild_tree puts them back
            prev = conn.execute(table.select().where(table.c.seq == seqs[0] - 1)).one().hash
            for seq in seqs:
                row = conn.execute(table.select().where(table.c.seq == seq)).one()
                digest = event_hash(
                    prev, EventFields(row.seq, row.at, row.kind, row.request_id, row.payload, row.dedup_key)
                )
                conn.execute(table.update().where(table.c.seq == seq).values(prev_hash=prev, hash=digest))
                prev = digest
    finally:
        engine.dispose()


def test_checkpoint_files_are_checked(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        read_checkpoint(bad)
    bad.write_text('{"sequence": "x"}')
    with pytest.raises(ConfigError, match="is not a checkpoint"):
        read_checkpoint(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        read_checkpoint(tmp_path / "missing.json")
