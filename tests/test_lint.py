"""The whole tree passes ruff's lint and format checks with the configuration in pyproject.toml (CI runs this)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")], ids=["lint", "format"])
def test_ruff_passes_over_the_tree(args):
    result = _ruff(*args)
    assert result.returncode == 0, f"ruff {' '.join(args)} found:\n{result.stdout}{result.stderr}"
