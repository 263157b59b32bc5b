"""verify and the exports run in flat memory over a request with a large n (one completion row at a time).

Before they streamed, verify joined every completion row with the request's finish event, whose
payload (one finish reason per completion) was decoded again for each row: 270 MB traced at
n = 2,000 and 1.6 GB at n = 5,000 (`python -m tests.audit.large_n --n 5000` on that checkout).
"""

from __future__ import annotations

from pathlib import Path

from loraledger.audit.export import read_rows
from tests.audit.large_n import build, measure

N = 3000
BOUND = 16_000_000  # bytes of traced Python memory; the joined form took hundreds of MB at this n


def test_verify_and_exports_of_a_large_n_request_stay_flat(migrated_db_url: str, tmp_path: Path):
    rid = build(migrated_db_url, N)
    figures = measure(migrated_db_url, tmp_path / "report")
    result, _, _ = figures["verify"]
    assert result.ok, result.problems
    assert result.completions == N
    for fmt in ("csv", "jsonl"):
        manifest, _, _ = figures[f"report_{fmt}"]
        assert manifest["verification"]["ok"] and manifest["counts"]["completions"] == N
        rows = list(read_rows(tmp_path / "report" / fmt / f"completions.{fmt}", fmt))
        assert len(rows) == N and {r["request_id"] for r in rows} == {rid}
        assert [int(r["completion_index"]) for r in rows] == list(range(N))
        code, _, _ = figures[f"requests_{fmt}"]
        assert code == 0
    for name, (_, top, seconds) in figures.items():
        print(f"{name}: peak {top / 1e6:.1f} MB traced in {seconds:.2f} s at n={N}")
        assert top < BOUND, f"{name} peaked at {top / 1e6:.1f} MB traced for one request with n={N}"
