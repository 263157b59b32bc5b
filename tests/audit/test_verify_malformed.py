"""Malformed rows are findings, not crashes: `loraledger audit verify` reports each at its row and exits 1.

Written behind the guards' back with raw SQL: values a typed read cannot decode (SQLite stores
whatever it is given) and JSON that decodes to the wrong shape (both dialects).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraledger.audit import AuditLog
from loraledger.cli import main
from tests.audit.synth import ADAPTERS, SynthLog
from tests.audit.tampering import event_seq, tamper


@dataclass
class Case:
    table: str
    key: dict[str, Any]
    sequence: int | None  # the event sequence number the problem is reported at
    sql: str
    params: dict[str, Any]


def _cases(url: str, synth: SynthLog, dialect: str) -> list[Case]:
    finished = [r.binding.request_id for r in synth.requests if r.outcome in ("stop", "length")]
    admitted = [r.binding.request_id for r in synth.requests if r.outcome in ("failed", "pending")]
    seq = lambda rid, kind: event_seq(url, rid, kind)  # noqa: E731
    json_cast = "" if dialect == "sqlite" else "::json"
    cases = [
        # NULL where a value is expected (a JSON null passes NOT NULL) and JSON of the wrong shape
        Case("events", {"seq": seq(admitted[0], "request_admitted")}, seq(admitted[0], "request_admitted"),
             f"UPDATE events SET payload = 'null'{json_cast} WHERE seq = :s", {"s": seq(admitted[0], "request_admitted")}),
        Case("completions", {"request_id": finished[0], "completion_index": 0}, seq(finished[0], "request_finished"),
             f"UPDATE completions SET token_ids = 'null'{json_cast} WHERE request_id = :r AND completion_index = 0", {"r": finished[0]}),
        Case("completions", {"request_id": finished[1], "completion_index": 0}, seq(finished[1], "request_finished"),
             f"UPDATE completions SET token_ids = '[\"a\", 1]'{json_cast} WHERE request_id = :r AND completion_index = 0", {"r": finished[1]}),
        Case("requests", {"request_id": admitted[1]}, seq(admitted[1], "request_admitted"),
             f"UPDATE requests SET sampling_params = 'null'{json_cast} WHERE request_id = :r", {"r": admitted[1]}),
        Case("events", {"seq": seq(finished[2], "request_finished")}, seq(finished[2], "request_finished"),
             f"UPDATE events SET payload = '\"just text\"'{json_cast} WHERE seq = :s", {"s": seq(finished[2], "request_finished")}),
        Case("adapters", {"fingerprint": ADAPTERS[1].fingerprint}, None,
             f"UPDATE adapters SET target_modules = '\"q_proj\"'{json_cast} WHERE fingerprint = :f", {"f": ADAPTERS[1].fingerprint}),
    ]  # fmt: skip
    if dialect == "sqlite":  # SQLite keeps any value in any column: what a typed read chokes on
        loaded = 1 + len(ADAPTERS) + 1  # after the registrations and engine_started: the first adapter_loaded
        cases += [
            Case("events", {"seq": seq(admitted[2], "request_admitted")}, seq(admitted[2], "request_admitted"),
                 "UPDATE events SET at = 'not a time' WHERE seq = :s", {"s": seq(admitted[2], "request_admitted")}),
            Case("events", {"seq": seq(finished[3], "request_finished")}, seq(finished[3], "request_finished"),
                 "UPDATE events SET payload = '{not json' WHERE seq = :s", {"s": seq(finished[3], "request_finished")}),
            Case("completions", {"request_id": finished[4], "completion_index": 0}, seq(finished[4], "request_finished"),
                 "UPDATE completions SET token_ids = 'not json' WHERE request_id = :r AND completion_index = 0", {"r": finished[4]}),
            Case("events", {"seq": "x"}, None, "UPDATE events SET seq = 'x' WHERE seq = :s", {"s": loaded}),
            Case("events", {"seq": seq(admitted[3], "request_admitted")}, seq(admitted[3], "request_admitted"),
                 "UPDATE events SET payload = '{\"binding\": NaN}' WHERE seq = :s", {"s": seq(admitted[3], "request_admitted")}),
            Case("completions", {"request_id": finished[5], "completion_index": 0}, seq(finished[5], "request_finished"),
                 "UPDATE completions SET first_token_at = 'yesterday' WHERE request_id = :r AND completion_index = 0", {"r": finished[5]}),
            Case("requests", {"request_id": admitted[4]}, seq(admitted[4], "request_admitted"),
                 "UPDATE requests SET prompt_token_count = 'many' WHERE request_id = :r", {"r": admitted[4]}),
            Case("requests", {"request_id": admitted[5]}, seq(admitted[5], "request_admitted"),
                 "UPDATE requests SET received_at = 'soon' WHERE request_id = :r", {"r": admitted[5]}),
            Case("adapters", {"fingerprint": ADAPTERS[0].fingerprint}, 1,
                 "UPDATE adapters SET use_rslora = 2 WHERE fingerprint = :f", {"f": ADAPTERS[0].fingerprint}),
            Case("adapters", {"fingerprint": ADAPTERS[2].fingerprint}, 3,
                 "UPDATE adapters SET first_seen = 'garbage' WHERE fingerprint = :f", {"f": ADAPTERS[2].fingerprint}),
        ]  # fmt: skip
    return cases


def test_malformed_rows_are_reported_at_their_rows_and_verify_exits_1(migrated_db_url: str, synth: SynthLog, capsys):
    url = migrated_db_url
    dialect = "sqlite" if url.startswith("sqlite") else "postgresql"
    cases = _cases(url, synth, dialect)
    for case in cases:
        tamper(url, case.sql, **case.params)
    code = main(["audit", "verify", "--url", url])
    out, err = capsys.readouterr()
    assert code == 1 and out.startswith("FAILED at ") and "Traceback" not in out + err, (out, err)
    with AuditLog(url) as log:
        result = log.verify()
    assert not result.ok
    for case in cases:
        hits = [
            p
            for p in result.problems
            if p.table == case.table and p.key and all(case.key.get(k) == v for k, v in p.key.items())
        ]
        assert hits, f"nothing names the `{case.table}` row {case.key} ({case.sql}): {result.problems}"
        if case.sequence is not None:
            assert case.sequence in {p.sequence for p in hits}, (case, hits)


def test_reports_and_listings_over_malformed_rows_fail_with_a_message(
    migrated_db_url: str, synth: SynthLog, capsys, tmp_path
):
    url = migrated_db_url
    dialect = "sqlite" if url.startswith("sqlite") else "postgresql"
    for case in _cases(url, synth, dialect):
        tamper(url, case.sql, **case.params)
    window = ["--since", "2026-11-01", "--until", "2026-12-31"]
    for fmt in ("csv", "jsonl"):
        code = main(
            ["audit", "report", "--url", url, *window, "--out", str(tmp_path / fmt), "--unsigned", "--format", fmt]
        )
        out, err = capsys.readouterr()
        # exported with a failed verification (exit 1), or refused with the first problem named (exit 2)
        assert code in (1, 2), (code, out, err)
        assert (
            ("did not verify" in out) if code == 1 else ("it did not verify" in err and not (tmp_path / fmt).exists())
        )
    for argv in (["audit", "requests", "--format", "csv"], ["audit", "adapters", "--format", "jsonl"]):
        code = main([*argv, "--url", url])
        _, err = capsys.readouterr()
        assert code == 0 or (code == 2 and "`loraledger audit verify` names the row" in err), (argv, code, err)
