"""`loraledger db upgrade | current | check`: manage the audit database's schema."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loraledger.store.db import display_url, make_engine, normalize_url, unavailable_as_error
from loraledger.store.migrate import current_revision, head_revision, schema_problems, upgrade


def _url(args: argparse.Namespace) -> str:
    if args.url:
        return str(args.url)
    from loraledger.cli import default_url

    return default_url()


def _add_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=None,
        help="SQLAlchemy URL of the audit database (default: $LORALEDGER_AUDIT_URL, else the engine's default SQLite file)",
    )


def _command(sub: argparse._SubParsersAction, name: str, text: str, func) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    parser = sub.add_parser(name, help=text, description=text)
    _add_url(parser)
    parser.set_defaults(func=func)
    return parser


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from loraledger.cli import show_help

    text = "the audit database: where it is, its schema revision, upgrades and guard checks"
    db = subparsers.add_parser("db", help=text, description=text)
    sub = db.add_subparsers(dest="db_command", title="commands", metavar="COMMAND")
    db.set_defaults(func=show_help(db))

    up = _command(
        sub, "upgrade", "migrate the audit database to the newest schema and reinstall missing guards", _cmd_upgrade
    )
    up.add_argument("--revision", default="head", help="target revision")
    _command(
        sub, "current", "print where the audit database is (URL, password masked) and its schema revision", _cmd_current
    )
    _command(sub, "check", "exit 1 unless the database is at head with every append-only guard", _cmd_check)


def _cmd_upgrade(args: argparse.Namespace) -> int:
    url = _url(args)
    revision = upgrade(url, args.revision)
    print(f"{display_url(url)}: at revision {revision} (head {head_revision()})")
    return 0


def _cmd_current(args: argparse.Namespace) -> int:
    url = _url(args)
    print(f"database  {display_url(url)}")
    missing = _missing_sqlite_file(url)
    if missing is not None:
        # a question must not create the file: the engine makes it, and its schema, on first use
        print(
            f"revision  none: {missing} does not exist yet (the engine creates it on first use; head {head_revision()})"
        )
        return 0
    with unavailable_as_error(url):
        engine = make_engine(url)
        try:
            revision = current_revision(engine)
        finally:
            engine.dispose()
    print(f"revision  {revision or 'none (no audit schema)'} (head {head_revision()})")
    return 0


def _missing_sqlite_file(url: str) -> Path | None:
    """The SQLite file url names, when it does not exist; None for any other URL."""
    parsed = normalize_url(url)
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:" or database.startswith("file:"):
        return None
    path = Path(database)
    return None if path.exists() else path


def _cmd_check(args: argparse.Namespace) -> int:
    url = _url(args)
    with unavailable_as_error(url):
        engine = make_engine(url)
        try:
            with engine.connect() as conn:
                problems = schema_problems(conn, url)
        finally:
            engine.dispose()
    if problems:
        print(f"{display_url(url)}: {'; '.join(problems)}", file=sys.stderr)
        return 1
    print(f"{display_url(url)}: ok, at head {head_revision()} with every append-only guard")
    return 0
