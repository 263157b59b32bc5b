"""The SQL views of revision 0003 (adapter_usage, request_lineage) on both dialects, against AuditLog."""

from __future__ import annotations

from sqlalchemy import text

from loraledger.audit import AuditLog
from loraledger.store.db import make_engine
from tests.audit.synth import SynthLog
from tests.audit.tampering import event_seq

LIFECYCLE = {"stop": "request_finished", "length": "request_finished", "abort": "request_aborted",
             "failed": "request_failed", "pending": None}  # fmt: skip


def _query(url: str, sql: str) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(sql)).all()
    finally:
        engine.dispose()


def test_adapter_usage_view_matches_usage(audit_log: AuditLog, migrated_db_url: str):
    rows = _query(
        migrated_db_url,
        "SELECT adapter_fingerprint, adapter_name, day, requests, prompt_tokens, generated_tokens, errors FROM adapter_usage",
    )
    view = {(r[0], r[2]): (r[1], r[3], r[4], r[5], r[6]) for r in rows}
    want = {
        (u.adapter_fingerprint, u.day): (u.lora_name, u.requests, u.prompt_tokens, u.generated_tokens, u.errors)
        for u in audit_log.usage(group_by=("adapter", "day"))
    }
    assert view == want and len(view) > 8


def test_request_lineage_view_links_request_adapter_and_completions(migrated_db_url: str, synth: SynthLog):
    rows = _query(
        migrated_db_url,
        "SELECT request_id, adapter_fingerprint, adapter_name, completion_index, completion_adapter_fingerprint, "
        "admitted_seq, last_lifecycle_event, finish_reason FROM request_lineage ORDER BY request_id, completion_index",
    )
    assert len(rows) == sum(max(1, len(r.completions)) for r in synth.requests)
    by_id: dict[str, list] = {}
    for row in rows:
        by_id.setdefault(row[0], []).append(row)
    for r in synth.requests[:15]:
        mine = by_id[r.binding.request_id]
        assert {row[1] for row in mine} == {r.binding.adapter_fingerprint}
        assert {row[2] for row in mine} == {r.binding.lora_name}
        assert [row[3] for row in mine] == ([c.index for c in r.completions] or [None])
        assert [row[7] for row in mine] == ([c.finish_reason for c in r.completions] or [None])
        if r.completions:
            assert {row[4] for row in mine} == {r.binding.adapter_fingerprint}
        assert {row[5] for row in mine} == {event_seq(migrated_db_url, r.binding.request_id, "request_admitted")}
        assert {row[6] for row in mine} == {LIFECYCLE[r.outcome]}
