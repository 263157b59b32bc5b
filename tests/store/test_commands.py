"""`loraledger db upgrade | current | check`."""

from __future__ import annotations

import argparse

from loraledger.store import db_cli as commands
from loraledger.store.db import display_url, make_engine
from loraledger.store.migrate import head_revision, upgrade


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="loraledger")
    commands.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_upgrade_current_and_check(db_url, capsys):
    assert run(["db", "check", "--url", db_url]) == 1
    assert "loraledger db upgrade --url" in capsys.readouterr().err
    assert run(["db", "current", "--url", db_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"database  {display_url(db_url)}" and lines[1].startswith("revision  none")
    assert run(["db", "upgrade", "--url", db_url]) == 0
    assert run(["db", "current", "--url", db_url]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"revision  {head_revision()} (head {head_revision()})"
    assert run(["db", "check", "--url", db_url]) == 0


def test_check_fails_behind_head_or_without_guards_and_upgrade_fixes_it(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'a.sqlite3'}"
    upgrade(url, "0001_initial")
    assert run(["db", "check", "--url", url]) == 1
    assert "behind head" in capsys.readouterr().err
    assert run(["db", "upgrade", "--url", url]) == 0
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TRIGGER completions_binding")
    engine.dispose()
    assert run(["db", "check", "--url", url]) == 1
    assert "completions_binding" in capsys.readouterr().err
    assert run(["db", "upgrade", "--url", url]) == 0
    assert run(["db", "check", "--url", url]) == 0


def test_url_defaults_to_the_environment(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'env.sqlite3'}"
    monkeypatch.setenv("LORALEDGER_AUDIT_URL", url)
    assert run(["db", "upgrade"]) == 0
    assert run(["db", "check", "--url", url]) == 0


def test_through_the_loraledger_command(tmp_path, capsys):
    from loraledger import cli  # the project's own modules: an import error fails the test, it does not skip it

    url = f"sqlite:///{tmp_path / 'a.sqlite3'}"
    assert cli.main(["db", "upgrade", "--url", url]) == 0
    assert cli.main(["db", "check", "--url", url]) == 0
    assert cli.main(["db", "upgrade", "--url", url, "--revision", "nonexistent"]) == 2
    assert "cannot upgrade" in capsys.readouterr().err
