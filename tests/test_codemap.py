"""CODEMAP.md names real files: every repository path it quotes exists, and every actor has a row in its table."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODEMAP = (ROOT / "CODEMAP.md").read_text(encoding="utf-8")
QUOTED = re.findall(r"`([^`\s]+)`", CODEMAP)


def named_paths(text_spans: list[str]) -> list[str]:
    """The quoted spans that are repository paths: a folder (ends in /) or a file with an extension."""
    return [s for s in text_spans if s.endswith("/") or re.fullmatch(r"[\w./-]+\.(py|md|toml)", s)]


def actor_modules() -> list[Path]:
    """The modules of actors/ whose docstring introduces an actor ('Scheduler actor: ...')."""
    return [p for p in sorted((ROOT / "actors").glob("*.py")) if re.match(r'"""\w+ actor:', p.read_text())]


def test_the_codemap_names_paths():
    assert len(named_paths(QUOTED)) >= 30, "CODEMAP.md quotes fewer paths than its sections need"


def test_every_path_the_codemap_names_exists():
    missing = [p for p in named_paths(QUOTED) if not (ROOT / p).exists()]
    assert not missing, f"CODEMAP.md names paths that are gone (update the map): {missing}"


def test_every_actor_module_has_a_row_in_the_codemap():
    actors = actor_modules()
    assert len(actors) >= 5, "few actors found: the docstring pattern no longer matches how actors are described"
    unlisted = [p.name for p in actors if f"`actors/{p.name}`" not in CODEMAP]
    assert not unlisted, f"actors without a row in CODEMAP.md: {unlisted}"


def test_every_actor_has_a_test_file_of_its_own():
    untested = [p.name for p in actor_modules() if not (ROOT / "tests" / "actors" / f"test_{p.name}").exists()]
    assert not untested, f"actors without tests/actors/test_<module>.py: {untested}"
