"""No two modules of the product or the benchmarks share a file name: each is named for what it holds, so a name
read in a traceback, an import or a review points at one room (`__init__.py` and the frozen migrations aside)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("loraledger", "actors", "gpu", "store", "audit", "bench")


def shared_names(root: Path) -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for top in PRODUCT:
        for path in sorted((root / top).rglob("*.py")):
            if path.name != "__init__.py" and ".cache" not in path.parts:
                where[path.name].append(str(path.relative_to(root)))
    return {name: paths for name, paths in where.items() if len(paths) > 1}


def test_every_module_has_a_name_of_its_own():
    assert shared_names(ROOT) == {}


def test_the_scan_finds_a_shared_name(tmp_path):
    for path in ("loraledger/a/config.py", "gpu/config.py", "audit/rows.py", "bench/__init__.py", "gpu/__init__.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert shared_names(tmp_path) == {"config.py": ["loraledger/a/config.py", "gpu/config.py"]}
