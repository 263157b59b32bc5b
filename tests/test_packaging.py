"""Every package of the source tree is in pyproject.toml's package list, so a non-editable install carries it."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join((package, *init.parent.relative_to(ROOT / folder).parts))
        for package, folder in tool["package-dir"].items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert found - set(tool["packages"]) == set(), "packages missing from pyproject.toml"
