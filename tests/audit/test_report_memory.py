"""A 25,000-request log exports in bounded memory: rows stream from the cursor to the files (100,000 requests:
python -m tests.audit.bulk_export)."""

from __future__ import annotations

from pathlib import Path

from tests.audit.bulk_export import ADAPTERS, MAX_PEAK, export_bulk_log

N = 25_000  # 18 MB of rows against a peak that stays near 9.5 MB from 10,000 to 100,000 requests


def test_a_25k_request_log_exports_in_bounded_memory(tmp_path: Path, report_env):
    done = export_bulk_log(tmp_path, N)
    counts = done.manifest["counts"]
    assert counts["requests"] == N and counts["completions"] == N
    assert counts["generated_tokens"] == 24 * N
    assert {g["adapter_fingerprint"]: g["requests"] for g in counts["by_adapter"]} == {
        **{a.fingerprint: N // 4 for a in ADAPTERS}, None: N // 4,
    }  # fmt: skip
    # the bulk rows have no events, so verification (which ran inside the export) names them all:
    # each request without its admission, each completion without its request's ending event
    assert done.manifest["verification"]["problem_count"] == 2 * N
    assert done.row_bytes > 15_000_000  # holding the rows as Python objects would take several times this
    assert done.peak < MAX_PEAK, (
        f"peak traced memory {done.peak / 1e6:.1f} MB while exporting {done.row_bytes / 1e6:.0f} MB of rows"
    )
    print(
        f"load {done.load_s:.1f} s, export {done.export_s:.1f} s, peak {done.peak / 1e6:.1f} MB, rows {done.row_bytes / 1e6:.0f} MB"
    )
