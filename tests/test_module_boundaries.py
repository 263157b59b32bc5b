"""No module reads or writes another module's private attributes: they go through its public names (EngineClient).

A private name is one that starts with a single underscore. The scan reads every Python file of the product and the
benchmarks (not the tests, which may look inside what they test): a module may use `obj._name` only when it defines
`_name` itself (a method, a class, `self._name = ...`, a module global); using one that only another module of the
tree defines (`engine._core`, `llm_engine._portal`), importing one (`from loraledger.x import _y`) or naming one to
getattr / setattr / hasattr is reaching into that module. Private names of other libraries (SQLAlchemy's
`row._mapping`, namedtuple's `_asdict`) are their own public API and not this scan's business.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("loraledger", "actors", "gpu", "store", "audit", "migrations", "bench")
BY_NAME = {"getattr", "setattr", "hasattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def defined_private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines: its functions, methods and classes, its globals and locals, the
    attributes it sets on itself (self._x = ...), and the names it imports as private aliases."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _own(node.value):
            names.add(node.attr)
        elif isinstance(node, ast.alias) and node.asname is not None:
            names.add(node.asname)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names.update(node.names)
    return {n for n in names if _private(n)}


def private_uses(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, private name, how) for each use of a private name on something other than self / cls."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            uses.append((node.lineno, node.attr, f".{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("loraledger"):
            uses += [(node.lineno, a.name, f"import {node.module}.{a.name}") for a in node.names if _private(a.name)]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in BY_NAME
            and len(node.args) >= 2
            and not _own(node.args[0])
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            uses.append((node.lineno, node.args[1].value, f'{node.func.id}(..., "{node.args[1].value}")'))
    return uses


def reaches(modules: dict[str, str]) -> list[str]:
    """Every use, in `modules` (path -> source), of a private name that another of them defines and it does not."""
    trees = {path: ast.parse(source, path) for path, source in modules.items()}
    defined = {path: defined_private_names(tree) for path, tree in trees.items()}
    found: list[tuple[str, int, str]] = []
    for path, tree in trees.items():
        others = set().union(*(names for other, names in defined.items() if other != path))
        for line, name, how in private_uses(tree):
            if name in others and name not in defined[path]:
                owners = sorted(other for other, names in defined.items() if other != path and name in names)
                found.append((path, line, f"{how} (private to {', '.join(owners)})"))
    return [f"{path}:{line}: {what}" for path, line, what in sorted(found)]


def test_no_module_reaches_into_another():
    modules = {
        str(path.relative_to(ROOT)): path.read_text(encoding="utf-8")
        for folder in SCANNED
        for path in sorted((ROOT / folder).rglob("*.py"))
        if ".cache" not in path.parts
    }
    assert len(modules) > 100  # the whole tree was read
    assert reaches(modules) == []


def test_the_scan_finds_each_way_of_reaching_in():
    engine = (
        "class AsyncEngine:\n"
        "    def __init__(self):\n"
        "        self._core = None\n"
        "    def _live(self):\n"
        "        return self._core\n"
        "_configured = False\n"
    )
    server = (
        "from loraledger.engine import _configured\n"
        "import loraledger.engine as ll\n"
        "class State:\n"
        "    def __init__(self, engine):\n"
        "        self.engine = engine\n"
        "        self._log = None\n"
        "    def dead(self):\n"
        "        self._log = 1\n"
        "        ll._configured = True\n"
        "        getattr(self.engine, '_core', None)\n"
        "        return self.engine._live() is None\n"
        "    def fine(self, rows, other):\n"
        "        return rows[0]._mapping, other._log, self.engine.is_running\n"
    )
    found = reaches({"engine.py": engine, "server.py": server})
    assert [f.split(": ", 1)[1] for f in found] == [
        "import loraledger.engine._configured (private to engine.py)",
        "._configured (private to engine.py)",
        'getattr(..., "_core") (private to engine.py)',
        "._live (private to engine.py)",
    ]


def bench_imports(root: Path) -> list[str]:
    """Test files outside tests/bench that import the benchmarks: the suite's checks of the product may not
    depend on bench/ (tests/bench checks the benchmarks' own catalogue and may)."""
    found = []
    for path in sorted((root / "tests").rglob("*.py")):
        if (root / "tests" / "bench") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any(n == "bench" or n.startswith("bench.") for n in names):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_the_tests_of_the_product_do_not_import_the_benchmarks():
    assert bench_imports(ROOT) == []


def test_the_bench_import_scan_sees_both_import_forms(tmp_path):
    (tmp_path / "tests" / "bench").mkdir(parents=True)
    (tmp_path / "tests" / "a.py").write_text("import bench.run\n")
    (tmp_path / "tests" / "b.py").write_text("from bench.slot_sim import simulate\n")
    (tmp_path / "tests" / "c.py").write_text("import benchmark_tools\nfrom loraledger import bench_x\n")
    (tmp_path / "tests" / "bench" / "d.py").write_text("from bench import run\n")
    assert bench_imports(tmp_path) == ["tests/a.py:1", "tests/b.py:1"]
