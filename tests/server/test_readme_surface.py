"""The README's route table and `loraledger serve` flag list against the app's routes and the command's argparse
flags: a route or a flag added, renamed or removed on one side only fails here, so the two cannot drift apart."""

from __future__ import annotations

import re
from pathlib import Path

from loraledger.cli import build_parser
from loraledger.server.app import build_app
from tests.server.conftest import server_config

README = Path(__file__).resolve().parents[2] / "README.md"


def _section(text: str, opening: str) -> str:
    """The README's text from the line starting with `opening` up to the next blank line followed by a non-list line
    (the table or the list it opens)."""
    start = text.index(opening)
    end = text.find("\n\n", text.index("\n\n", start) + 2)
    return text[start : end if end != -1 else len(text)]


def readme_routes() -> set[tuple[str, str]]:
    table = _section(README.read_text(), "Routes (`tests/server/test_readme_surface.py`")
    return set(re.findall(r"`(GET|POST|PUT|DELETE) (/[^`\s]*)`", table))


def readme_flags() -> set[str]:
    block = _section(README.read_text(), "Flags of `loraledger serve`")
    return set(re.findall(r"`(--[a-z0-9-]+)`", block.split(":", 1)[1]))


def app_routes(tiny, tmp_path) -> set[tuple[str, str]]:
    """Every (method, path) the app serves, from its OpenAPI description (FastAPI's public view of its routes)."""
    app = build_app(server_config(tiny, tmp_path, None, insecure_no_auth=True))  # no engine starts: no lifespan
    paths = app.openapi()["paths"]
    return {(method.upper(), path.replace("{model_id}", "{id}")) for path, ops in paths.items() for method in ops}


def serve_flags() -> set[str]:
    parser = build_parser()
    (subcommands,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    serve = subcommands.choices["serve"]
    return {o for a in serve._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


def test_the_readme_route_table_is_the_apps(tiny_llama, tmp_path):
    listed, served = readme_routes(), app_routes(tiny_llama, tmp_path)
    assert listed, "no route found in the README's table"
    assert served - listed == set(), f"routes the README does not list: {sorted(served - listed)}"
    assert listed - served == set(), f"routes the README lists that the app does not serve: {sorted(listed - served)}"


def test_the_readme_flag_list_is_serves(tmp_path):
    listed, flags = readme_flags(), serve_flags()
    assert listed, "no flag found in the README's list"
    assert flags - listed == set(), f"flags the README does not list: {sorted(flags - listed)}"
    assert listed - flags == set(), (
        f"flags the README lists that `loraledger serve` does not have: {sorted(listed - flags)}"
    )


def test_the_server_section_says_structured_outputs_are_served():
    text = README.read_text()
    section = text[text.index("## Serve over HTTP") : text.index("## Scale out")]
    (not_served,) = re.findall(r"Not served: ([^.]*)\.", section)
    assert "structured" not in not_served and "response_format" not in not_served
    assert "[Structured outputs](#structured-outputs)" in section
