"""No module of the product or the benchmarks is over MAX_LINES lines: one concept per module, small enough to read.

The few that are still over it are listed with their size today; they may shrink, never grow, and leave the list
once they are split (a listed file that is back under the limit fails the test until its entry goes).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("loraledger", "actors", "gpu", "store", "audit", "migrations", "bench", "scripts", "examples")
MAX_LINES = 500
STILL_OVER = {  # path: its line count when listed
    "store/audit_store.py": 518,
}


def line_counts() -> dict[str, int]:
    return {
        str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
        for top in SCANNED
        for p in sorted((ROOT / top).rglob("*.py"))
    }


def test_no_module_is_over_the_limit():
    counts = line_counts()
    assert len(counts) > 100, "the scan found too few modules: SCANNED no longer matches the layout"
    over = {path: n for path, n in counts.items() if n > MAX_LINES and path not in STILL_OVER}
    assert not over, f"modules over {MAX_LINES} lines (split them along their seams): {over}"


def test_the_modules_still_over_the_limit_do_not_grow_and_leave_the_list_once_split():
    counts = line_counts()
    grown = {path: counts[path] for path, n in STILL_OVER.items() if counts.get(path, 0) > n}
    assert not grown, f"listed modules grew past their listed size; split them instead: {grown}"
    done = [path for path in STILL_OVER if counts.get(path, 0) <= MAX_LINES]
    assert not done, f"these are at most {MAX_LINES} lines now (or gone): remove them from STILL_OVER: {done}"
