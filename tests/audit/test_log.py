"""AuditLog queries on both dialects, checked against the synthetic log they were written from."""

from __future__ import annotations

import datetime as dt
import random

import msgspec
import pytest
from sqlalchemy import text

from loraledger.audit import AuditLog
from loraledger.digests import stored_time
from loraledger.errors import AuditSchemaError, AuditUnavailableError, ConfigError, UnknownRequestError
from loraledger.store.db import make_engine
from loraledger.store.records import EventKind
from tests.audit.synth import ADAPTERS, DAY, START, SynthLog, SynthRequest

STATUS = {"stop": "finished", "length": "finished", "abort": "aborted", "failed": "failed", "pending": "pending"}


def _day(t: float) -> str:
    return dt.datetime.fromtimestamp(t, tz=dt.timezone.utc).strftime("%Y-%m-%d")


def _matches(r: SynthRequest, *, adapter=None, tenant=None, since=None, until=None, finish_reason=None) -> bool:
    b = r.binding
    return (
        (adapter is None or adapter in (b.adapter_fingerprint, b.lora_name))
        and (tenant is None or b.tenant == tenant)
        and (since is None or stored_time(b.received_at) >= since)
        and (until is None or stored_time(b.received_at) < until)
        and (finish_reason is None or any(c.finish_reason == finish_reason for c in r.completions))
    )


def test_request_lineage_is_binding_adapter_completions_and_events(audit_log: AuditLog, synth: SynthLog):
    multi = next(r for r in synth.requests if len(r.completions) > 1 and r.binding.adapter_fingerprint)
    lineage = audit_log.request(multi.binding.request_id)
    expected_binding = msgspec.structs.replace(multi.binding, received_at=stored_time(multi.binding.received_at))
    assert lineage.binding == expected_binding
    assert lineage.adapter is not None and lineage.adapter.fingerprint == multi.binding.adapter_fingerprint
    assert lineage.adapter == next(a for a in ADAPTERS if a.fingerprint == multi.binding.adapter_fingerprint)
    assert [c.index for c in lineage.completions] == list(range(len(multi.completions)))
    for got, want in zip(lineage.completions, multi.completions):
        assert (got.text, got.token_ids, got.finish_reason, got.adapter_fingerprint) == (
            want.text, want.token_ids, want.finish_reason, want.adapter_fingerprint,
        )  # fmt: skip
        assert got.finished_at == stored_time(want.finished_at)
    assert [e.kind for e in lineage.events] == [EventKind.REQUEST_ADMITTED, EventKind.REQUEST_FINISHED]
    assert lineage.events[0].sequence < lineage.events[1].sequence
    assert lineage.events[1].prev_hash != lineage.events[0].prev_hash
    assert lineage.status == "finished"

    base = next(r for r in synth.requests if r.binding.adapter_fingerprint is None)
    assert audit_log.request(base.binding.request_id).adapter is None
    with pytest.raises(UnknownRequestError, match="no-such-request"):
        audit_log.request("no-such-request")


def test_request_listing_filters_match_the_log(audit_log: AuditLog, synth: SynthLog):
    rng = random.Random(7)
    cases = [
        {},
        {"adapter": ADAPTERS[0].name},
        {"adapter": ADAPTERS[1].fingerprint, "tenant": "acme"},
        {"finish_reason": "length"},
        {"finish_reason": "abort", "since": START + DAY},
    ]
    for _ in range(4):
        lo = START + rng.random() * 4 * DAY
        cases.append({"since": lo, "until": lo + rng.random() * 2 * DAY, "tenant": rng.choice(["globex", None])})
    for case in cases:
        want = [r for r in synth.requests if _matches(r, **case)]
        got = list(audit_log.requests(**case))
        assert [g.request_id for g in got] == [r.binding.request_id for r in want], case
        for g, r in zip(got, want):
            assert g.status == STATUS[r.outcome]
            assert g.num_completions == len(r.completions)
            assert g.generated_tokens == sum(c.generated_token_count for c in r.completions)
            assert g.finish_reasons == (",".join(sorted({c.finish_reason for c in r.completions})) or None)
    assert len(list(audit_log.requests(limit=7))) == 7
    iso_since = dt.datetime.fromtimestamp(START + DAY, tz=dt.timezone.utc).isoformat()
    assert [r.request_id for r in audit_log.requests(since=iso_since)] == [
        r.binding.request_id for r in synth.requests if _matches(r, since=START + DAY)
    ]
    with pytest.raises(ConfigError, match="not an ISO-8601 time"):
        list(audit_log.requests(since="last tuesday"))


@pytest.mark.parametrize("group_by", [("adapter", "tenant", "day"), ("adapter",), ("day",), ()])
def test_usage_sums_per_group(audit_log: AuditLog, synth: SynthLog, group_by):
    def key(r: SynthRequest) -> tuple:
        b = r.binding
        parts = {"adapter": b.adapter_fingerprint, "tenant": b.tenant, "day": _day(stored_time(b.received_at))}
        return tuple(parts[k] for k in group_by)

    metrics = ("requests", "prompt_tokens", "generated_tokens", "errors")
    want: dict[tuple, dict[str, int]] = {}
    for r in synth.requests:
        c = want.setdefault(key(r), dict.fromkeys(metrics, 0))
        c["requests"] += 1
        c["prompt_tokens"] += r.binding.prompt_token_count
        c["generated_tokens"] += sum(x.generated_token_count for x in r.completions)
        c["errors"] += r.outcome == "failed"
    got = {}
    for row in audit_log.usage(group_by=group_by):
        parts = {"adapter": row.adapter_fingerprint, "tenant": row.tenant, "day": row.day}
        got[tuple(parts[k] for k in group_by)] = {m: getattr(row, m) for m in metrics}
        if "adapter" in group_by and row.adapter_fingerprint:
            assert row.lora_name == next(a.name for a in ADAPTERS if a.fingerprint == row.adapter_fingerprint)
    assert got == want
    with pytest.raises(ConfigError, match="group_by"):
        list(audit_log.usage(group_by=("model",)))


def test_adapter_inventory_counts_first_and_last_use(audit_log: AuditLog, synth: SynthLog):
    inventory = {a.record.fingerprint: a for a in audit_log.adapters()}
    assert set(inventory) == {a.fingerprint for a in ADAPTERS}
    for adapter in ADAPTERS:
        mine = [
            stored_time(r.binding.received_at)
            for r in synth.requests
            if r.binding.adapter_fingerprint == adapter.fingerprint
        ]
        info = inventory[adapter.fingerprint]
        assert info.record == adapter
        assert (info.requests, info.first_used, info.last_used) == (len(mine), min(mine), max(mine))


def test_opening_a_missing_or_foreign_database_says_what_is_wrong(tmp_path, db_url):
    with pytest.raises(AuditUnavailableError, match="does not exist"):
        AuditLog(f"sqlite:///{tmp_path / 'nope.sqlite3'}").open()
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE something_else (x INTEGER)"))
    engine.dispose()
    with pytest.raises(AuditSchemaError, match="no loraledger audit log"):
        AuditLog(db_url).open()
