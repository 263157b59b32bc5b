"""A bulk-loaded log of N requests and one completion each, exported under tracemalloc: the export's peak traced
memory against the bytes of rows it wrote. tests/audit/test_report_memory.py runs it at 25,000 requests; the full size:

    python -m tests.audit.bulk_export                  # 100,000 requests; exit 1 past the bound
    python -m tests.audit.bulk_export --requests 250000 --max-peak-mb 12
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

CHUNK = 5_000
FULL = 100_000
MAX_PEAK = 12_000_000  # bytes of traced memory; holding the rows as Python objects takes several times their bytes
TENANTS = ("acme", "globex", "initech", None)


def _rows(start: int, stop: int, n: int) -> tuple[list[dict], list[dict]]:
    """Rows of requests start..stop-1 and one completion each, times in the store's SQLite text form."""
    requests, completions = [], []
    for i in range(start, stop):
        adapter = ADAPTERS[i % 4] if i % 4 < 3 else None
        at = START + i * (10 * DAY / n)
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


def _bulk_load(url: str, n: int) -> None:
    with AuditStore(url) as store:
        store.write(AuditBatch(adapters=list(ADAPTERS)))
    engine = make_engine(url)
    requests_t, completions_t = _untyped(Request.__table__), _untyped(Completion.__table__)
    try:
        for start in range(0, n, CHUNK):
            requests, completions = _rows(start, min(n, start + CHUNK), n)
            with engine.begin() as conn:
                conn.execute(insert(requests_t), requests)
                conn.execute(insert(completions_t), completions)
    finally:
        engine.dispose()


@dataclass
class Export:
    manifest: dict[str, Any]
    peak: int  # bytes of traced memory at the export's peak
    row_bytes: int  # bytes of the row files it wrote
    load_s: float
    export_s: float


def export_bulk_log(workdir: Path, n: int) -> Export:
    """Bulk-load n requests into a new SQLite log under workdir and export them (the signing key from the
    environment's LORALEDGER_REPORT_KEY)."""
    url = f"sqlite:///{workdir / 'audit.sqlite3'}"
    upgrade(url)
    t0 = time.monotonic()
    _bulk_load(url, n)
    loaded = time.monotonic()
    with AuditLog(url) as log:
        tracemalloc.start()
        try:
            manifest = write_report(log, workdir / "report", since=START, until=START + 11 * DAY, progress=False)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    row_bytes = sum(f["bytes"] for f in manifest["files"] if f["rows"] is not None)
    return Export(manifest, peak, row_bytes, loaded - t0, time.monotonic() - loaded)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.audit.bulk_export", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=FULL)
    parser.add_argument("--max-peak-mb", type=float, default=MAX_PEAK / 1e6)
    args = parser.parse_args(argv)
    os.environ.setdefault("LORALEDGER_REPORT_KEY", "bulk-export-key-0123456789")
    with tempfile.TemporaryDirectory() as tmp:
        done = export_bulk_log(Path(tmp), args.requests)
    counts = done.manifest["counts"]
    print(
        f"{counts['requests']} requests: load {done.load_s:.1f} s, export {done.export_s:.1f} s, "
        f"peak {done.peak / 1e6:.1f} MB, rows {done.row_bytes / 1e6:.0f} MB"
    )
    return 0 if counts["requests"] == args.requests and done.peak < args.max_peak_mb * 1e6 else 1


if __name__ == "__main__":
    sys.exit(main())
