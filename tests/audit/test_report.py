"""Report export on both dialects: counts equal direct SQL counts, signing, previous-report chaining."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
from sqlalchemy import func, or_, select

from loraledger.audit import AuditLog
from loraledger.audit.export import read_rows
from loraledger.audit.report import MANIFEST, write_report
from loraledger.audit.report_verify import verify_report
from loraledger.audit.signing import generate_ed25519_key
from loraledger.audit.timefmt import iso
from loraledger.digests import stored_time
from loraledger.errors import ConfigError
from loraledger.store.audit_store import AuditStore
from loraledger.store.db import make_engine
from loraledger.store.models import Completion, Event, Request, utc_from_unix
from tests.audit.synth import ADAPTERS, DAY, START, SynthLog, build_formula_log, build_log


def _sql_counts(url: str, since: float, until: float, adapter: str | None, tenant: str | None) -> dict:
    """The counts a report must carry, straight from the tables."""
    where = [Request.received_at >= utc_from_unix(since), Request.received_at < utc_from_unix(until)]
    if adapter is not None:
        where.append(or_(Request.adapter_fingerprint == adapter, Request.lora_name == adapter))
    if tenant is not None:
        where.append(Request.tenant == tenant)
    failed = select(Event.seq).where(Event.request_id == Request.request_id, Event.kind == "request_failed").exists()
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            one = lambda stmt: conn.execute(stmt).scalar_one()  # noqa: E731
            joined = (
                select(func.count()).select_from(Completion).join(Request, Request.request_id == Completion.request_id)
            )
            per_adapter = (
                select(Request.adapter_fingerprint, func.count()).where(*where).group_by(Request.adapter_fingerprint)
            )
            per_tenant = select(Request.tenant, func.count()).where(*where).group_by(Request.tenant)
            per_reason = (
                select(Completion.finish_reason, func.count())
                .join(Request, Request.request_id == Completion.request_id)
                .where(*where)
                .group_by(Completion.finish_reason)
            )
            return {
                "requests": one(select(func.count()).select_from(Request).where(*where)),
                "completions": one(joined.where(*where)),
                "prompt_tokens": one(select(func.coalesce(func.sum(Request.prompt_token_count), 0)).where(*where)),
                "generated_tokens": int(
                    one(
                        select(func.coalesce(func.sum(Completion.generated_token_count), 0))
                        .join(Request, Request.request_id == Completion.request_id)
                        .where(*where)
                    )
                ),
                "errors": one(select(func.count()).select_from(Request).where(*where, failed)),
                "by_adapter": dict(conn.execute(per_adapter).all()),
                "by_tenant": dict(conn.execute(per_tenant).all()),
                "by_finish_reason": dict(conn.execute(per_reason).all()),
            }
    finally:
        engine.dispose()


def test_report_counts_equal_direct_sql_counts(migrated_db_url: str, synth: SynthLog, tmp_path, report_env):
    rng = random.Random(11)
    cases = [(START, START + 5 * DAY, None, None), (START, START + 5 * DAY, ADAPTERS[2].name, None)]
    for _ in range(3):
        lo = START + rng.random() * 3 * DAY
        cases.append(
            (
                lo,
                lo + (0.5 + rng.random() * 2) * DAY,
                rng.choice([None, ADAPTERS[0].fingerprint]),
                rng.choice([None, "acme"]),
            )
        )
    with AuditLog(migrated_db_url) as log:
        for i, (lo, hi, adapter, tenant) in enumerate(cases):
            out = tmp_path / f"report{i}"
            manifest = write_report(log, out, since=lo, until=hi, adapter=adapter, tenant=tenant, progress=False)
            want = _sql_counts(migrated_db_url, lo, hi, adapter, tenant)
            counts = manifest["counts"]
            for key in ("requests", "completions", "prompt_tokens", "generated_tokens", "errors"):
                assert counts[key] == want[key], (key, lo, hi, adapter, tenant)
            assert {g["adapter_fingerprint"]: g["requests"] for g in counts["by_adapter"]} == want["by_adapter"]
            assert {g["tenant"]: g["requests"] for g in counts["by_tenant"]} == want["by_tenant"]
            assert {g["finish_reason"]: g["completions"] for g in counts["by_finish_reason"]} == want[
                "by_finish_reason"
            ]
            for group in ("by_adapter", "by_tenant"):
                assert sum(g["requests"] for g in counts[group]) == counts["requests"]
                assert sum(g["completions"] for g in counts[group]) == counts["completions"]
            files = {f["name"]: f for f in manifest["files"]}
            assert files["requests.csv"]["rows"] == counts["requests"]
            assert files["completions.csv"]["rows"] == counts["completions"]
            assert manifest["verification"]["ok"] and manifest["chain_head"]["sequence"] == synth.events
            assert manifest["filters"] == {"adapter": adapter, "tenant": tenant, "instance": None}
            assert manifest["signature"]["algorithm"] == "hmac-sha256"
            assert verify_report(out).ok


def test_report_rows_carry_the_bindings(migrated_db_url: str, synth: SynthLog, tmp_path, report_env):
    with AuditLog(migrated_db_url) as log:
        write_report(log, tmp_path / "r", since=START, until=START + 10 * DAY, fmt="jsonl", progress=False)
    requests = {r["request_id"]: r for r in read_rows(tmp_path / "r" / "requests.jsonl", "jsonl")}
    assert list(requests) == [r.binding.request_id for r in synth.requests]  # received order
    for r in synth.requests:
        row = requests[r.binding.request_id]
        assert (row["adapter_fingerprint"], row["lora_name"], row["tenant"]) == (
            r.binding.adapter_fingerprint, r.binding.lora_name, r.binding.tenant,
        )  # fmt: skip
        assert row["sampling_params"] == r.binding.sampling_params
        # every audited fact of the binding an auditor reads beside the output: who called, with which key, the chat
        # template, the structured-output constraint, the engine instance (the synth log fills each for some rows)
        audited = (
            "caller_request_id",
            "key_id",
            "chat_template_sha256",
            "constraint_kind",
            "constraint_sha256",
            "constraint_text",
        )
        assert {name: row[name] for name in audited} == {name: getattr(r.binding, name) for name in audited}
        assert row["num_completions"] == len(r.completions)
        assert row["received_at"] == iso(stored_time(r.binding.received_at))  # the database's ISO text agrees
    finished = {(c.request_id, c.index): iso(stored_time(c.finished_at)) for r in synth.requests for c in r.completions}
    completions = list(read_rows(tmp_path / "r" / "completions.jsonl", "jsonl"))
    assert {(c["request_id"], c["completion_index"]): c["finished_at"] for c in completions} == finished
    assert {c["text"] for c in completions} == {c.text for r in synth.requests for c in r.completions}
    assert any(row["constraint_kind"] for row in requests.values()) and any(row["key_id"] for row in requests.values())
    assert verify_report(tmp_path / "r").ok


def test_an_unsigned_report_needs_the_flag(migrated_db_url: str, synth: SynthLog, tmp_path, monkeypatch):
    monkeypatch.delenv("LORALEDGER_REPORT_KEY", raising=False)
    with AuditLog(migrated_db_url) as log:
        with pytest.raises(ConfigError, match="--unsigned"):
            write_report(log, tmp_path / "r", since=START, until=START + DAY, progress=False)
        assert not (tmp_path / "r").exists()
        manifest = write_report(log, tmp_path / "r", since=START, until=START + DAY, unsigned=True, progress=False)
        with pytest.raises(ConfigError, match="not empty"):
            write_report(log, tmp_path / "r", since=START, until=START + DAY, unsigned=True, progress=False)
        with pytest.raises(ConfigError, match="since < until"):
            write_report(log, tmp_path / "r2", since=START + DAY, until=START, unsigned=True, progress=False)
    assert manifest["signature"] == {"algorithm": "none", "key_id": None, "public_key": None, "value": None}
    check = verify_report(tmp_path / "r")
    assert not check.ok and "unsigned" in check.problems[0]
    assert verify_report(tmp_path / "r", allow_unsigned=True).ok


def test_ed25519_signed_report(migrated_db_url: str, synth: SynthLog, tmp_path, monkeypatch):
    monkeypatch.delenv("LORALEDGER_REPORT_KEY", raising=False)
    generate_ed25519_key(tmp_path / "key.pem", tmp_path / "pub.pem")
    generate_ed25519_key(tmp_path / "other.pem", tmp_path / "other_pub.pem")
    with AuditLog(migrated_db_url) as log:
        manifest = write_report(
            log, tmp_path / "r", since=START, until=START + 2 * DAY, key_file=tmp_path / "key.pem", progress=False
        )
    assert manifest["signature"]["algorithm"] == "ed25519"
    assert verify_report(tmp_path / "r", key_file=tmp_path / "pub.pem").ok
    assert verify_report(tmp_path / "r", key_file=tmp_path / "key.pem").ok  # the private key holds the public one
    wrong = verify_report(tmp_path / "r", key_file=tmp_path / "other_pub.pem")
    assert not wrong.ok and "Ed25519 signature does not match" in wrong.problems[0]
    with pytest.raises(ConfigError, match="--key-file"):
        verify_report(tmp_path / "r")


def test_a_report_chains_to_the_previous_one(migrated_db_url: str, synth: SynthLog, tmp_path, report_env):
    with AuditLog(migrated_db_url) as log:
        write_report(log, tmp_path / "r1", since=START, until=START + 5 * DAY, progress=False)
    with AuditStore(migrated_db_url) as store:
        build_log(store, n_requests=10, days=1, seed=1)
    with AuditLog(migrated_db_url) as log:
        manifest = write_report(
            log, tmp_path / "r2", since=START, until=START + 5 * DAY, previous=tmp_path / "r1", progress=False
        )
    first = json.loads((tmp_path / "r1" / MANIFEST).read_bytes())
    assert manifest["previous"] == {
        "manifest_sha256": hashlib.sha256((tmp_path / "r1" / MANIFEST).read_bytes()).hexdigest(),
        "chain_head": first["chain_head"],
    }
    assert manifest["verification"]["ok"] and manifest["verification"]["checked_against_previous"]
    assert manifest["chain_head"]["sequence"] > first["chain_head"]["sequence"]
    assert verify_report(tmp_path / "r2", previous=tmp_path / "r1").ok
    mismatch = verify_report(tmp_path / "r2", previous=tmp_path / "r2")
    assert not mismatch.ok and "is not the one this report follows" in mismatch.problems[0]


def test_a_failed_export_leaves_no_half_bundle(
    migrated_db_url: str, synth: SynthLog, tmp_path, report_env, monkeypatch
):
    import loraledger.audit.report as report

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(report, "render_report_html", broken)
    with AuditLog(migrated_db_url) as log:
        with pytest.raises(OSError, match="disk full"):
            write_report(log, tmp_path / "r", since=START, until=START + DAY, progress=False)
        assert not (tmp_path / "r").exists()
        with pytest.raises(ConfigError, match="is not a loraledger report manifest"):
            (tmp_path / "junk").mkdir()
            (tmp_path / "junk" / MANIFEST).write_text("[]")
            write_report(
                log, tmp_path / "r", since=START, until=START + DAY, previous=tmp_path / "junk", progress=False
            )
        assert not (tmp_path / "r").exists()


def test_csv_report_cells_cannot_start_a_formula_and_jsonl_stays_exact(migrated_db_url: str, tmp_path, report_env):
    import csv

    values = build_formula_log(migrated_db_url)
    with AuditLog(migrated_db_url) as log:
        for fmt in ("csv", "jsonl"):
            manifest = write_report(log, tmp_path / fmt, since=START, until=START + DAY, fmt=fmt, progress=False)
            assert manifest["verification"]["ok"], manifest["verification"]
    for name, columns in (("requests", ("tenant", "prompt_text")), ("completions", ("tenant", "text", "stop_reason"))):
        with open(tmp_path / "csv" / f"{name}.csv", newline="", encoding="utf-8") as file:
            raw = list(csv.DictReader(file))
        assert len(raw) == len(values)
        for row, value in zip(raw, values):
            for column in columns:
                assert row[column] == "'" + value, (name, column, row[column])
        exact = list(read_rows(tmp_path / "jsonl" / f"{name}.jsonl", "jsonl"))
        assert [[row[c] for c in columns] for row in exact] == [[value] * len(columns) for value in values]
        assert [row["tenant"] for row in read_rows(tmp_path / "csv" / f"{name}.csv", "csv")] == values
    # the recount reads the neutralised cells back as the values the manifest counted
    assert verify_report(tmp_path / "csv").ok and verify_report(tmp_path / "jsonl").ok


def test_a_forged_adapter_name_never_shows_under_a_verified_banner(
    migrated_db_url: str, synth: SynthLog, tmp_path, report_env
):
    from tests.audit.tampering import tamper

    tamper(
        migrated_db_url,
        "UPDATE adapters SET name = 'approved-safe-adapter' WHERE fingerprint = :f",
        f=ADAPTERS[0].fingerprint,
    )
    with AuditLog(migrated_db_url) as log:
        manifest = write_report(log, tmp_path / "r", since=START, until=START + 10 * DAY, progress=False)
    html = (tmp_path / "r" / "report.html").read_text()
    assert not manifest["verification"]["ok"]
    assert (
        "in: name" in manifest["verification"]["problem"]
        and ADAPTERS[0].fingerprint in manifest["verification"]["problem"]
    )
    assert "Audit log verified" not in html and "verification FAILED" in html
