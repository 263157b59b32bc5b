"""A 100,000-request log exports in bounded memory: rows stream from the cursor to the files."""

from __future__ import annotations

import datetime as dt
import time
import tracemalloc
from pathlib import Path

from sqlalchemy import Table, column, insert
from sqlalchemy import table as sa_table
from sqlalchemy.sql.expression import TableClause

from loraledger.audit import AuditLog
from loraledger.audit.report import write_report
from loraledger.store.audit_store import AuditStore
from loraledger.store.db import make_engine
from loraledger.store.migrate import upgrade
from loraledger.store.models import Completion, Request
from loraledger.store.records import AuditBatch
from tests.audit.synth import ADAPTERS, BASE_FP, DAY, START

N = 100_000
CHUNK = 5_000
TENANTS = ("acme", "globex", "initech", None)


def _rows(start: int, stop: int) -> tuple[list[dict], list[dict]]:
    """Rows of requests start..stop-1 and one completion each, times in the store's SQLite text form."""
    requests, completions = [], []
    for i in range(start, stop):
        adapter = ADAPTERS[i % 4] if i % 4 < 3 else None
        at = START + i * (10 * DAY / N)
        request_id = f"bulk-{i:06d}"
        requests.append(
            {
                "request_id": request_id,
                "adapter_fingerprint": adapter.fingerprint if adapter else None,
                "lora_name": adapter.name if adapter else None,
                "lora_int_id": adapter.int_id if adapter else None,
                "lora_path": adapter.path if adapter else None,
                "tenant": TENANTS[i % 7 % 4],
                "sampling_params": '{"max_tokens": 32, "n": 1, "temperature": 0.0}',
                "prompt_text": f"Summarise clause {i} of the master services agreement in plain words.",
                "prompt_sha256": f"{i:064x}",
                "prompt_token_count": 12 + i % 50,
                "received_at": _sqlite_time(at),
                "engine_version": "0.1.0",
                "base_model_fingerprint": BASE_FP,
            }
        )
        completions.append(
            {
                "request_id": request_id,
                "completion_index": 0,
                "text": f"Clause {i} says the supplier must deliver on time and fix defects within thirty days. " * 2,
                "token_ids": "[" + ", ".join(str(t) for t in range(i % 7, i % 7 + 24)) + "]",
                "cumulative_logprob": -1.5,
                "finish_reason": "stop" if i % 5 else "length",
                "stop_reason": None,
                "adapter_fingerprint": adapter.fingerprint if adapter else None,
                "prompt_token_count": 12 + i % 50,
                "generated_token_count": 24,
                "first_token_at": _sqlite_time(at + 0.05),
                "finished_at": _sqlite_time(at + 0.5),
            }
        )
    return requests, completions


def _sqlite_time(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f+00:00")


def _untyped(table: Table) -> TableClause:
    """table without its column types: executemany passes the prepared values straight to the driver."""
    return sa_table(table.name, *(column(c.name) for c in table.c))


def _bulk_load(url: str) -> None:
    with AuditStore(url) as store:
        store.write(AuditBatch(adapters=list(ADAPTERS)))
    engine = make_engine(url)
    requests_t, completions_t = _untyped(Request.__table__), _untyped(Completion.__table__)
    try:
        for start in range(0, N, CHUNK):
            requests, completions = _rows(start, start + CHUNK)
            with engine.begin() as conn:
                conn.execute(insert(requests_t), requests)
                conn.execute(insert(completions_t), completions)
    finally:
        engine.dispose()


def test_a_100k_request_log_exports_in_bounded_memory(tmp_path: Path, report_env):
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    upgrade(url)
    t0 = time.monotonic()
    _bulk_load(url)
    loaded = time.monotonic()
    with AuditLog(url) as log:
        tracemalloc.start()
        try:
            manifest = write_report(log, tmp_path / "report", since=START, until=START + 11 * DAY, progress=False)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    exported = time.monotonic()
    counts = manifest["counts"]
    assert counts["requests"] == N and counts["completions"] == N
    assert counts["generated_tokens"] == 24 * N
    assert {g["adapter_fingerprint"]: g["requests"] for g in counts["by_adapter"]} == {
        **{a.fingerprint: N // 4 for a in ADAPTERS}, None: N // 4,
    }  # fmt: skip
    # the bulk rows have no events, so verification (which ran inside the export) names them all:
    # each request without its admission, each completion without its request's ending event
    assert manifest["verification"]["problem_count"] == 2 * N
    row_bytes = sum(f["bytes"] for f in manifest["files"] if f["rows"] is not None)
    assert row_bytes > 40_000_000  # holding the rows as Python objects would take several times this
    assert peak < 12_000_000, f"peak traced memory {peak / 1e6:.1f} MB while exporting {row_bytes / 1e6:.0f} MB of rows"
    print(
        f"load {loaded - t0:.1f} s, export {exported - loaded:.1f} s, peak {peak / 1e6:.1f} MB, rows {row_bytes / 1e6:.0f} MB"
    )
