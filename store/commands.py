"""`loraledger db upgrade | current | check`: manage the audit database's schema."""

from __future__ import annotations

import argparse
import sys

from loraledger.store.db import display_url, make_engine, unavailable_as_error
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
        help="SQLAlchemy URL of the audit database (default: $LORALEDGER_AUDIT_URL, else the engine's SQLite file)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    db = subparsers.add_parser("db", help="the audit database's schema: upgrade, current, check")
    sub = db.add_subparsers(dest="db_command", required=True)

    up = sub.add_parser("upgrade", help="migrate the audit database to the newest schema and reinstall missing guards")
    _add_url(up)
    up.add_argument("--revision", default="head", help="target revision (default: head)")
    up.set_defaults(func=_cmd_upgrade)

    current = sub.add_parser("current", help="print the audit database's schema revision and the head revision")
    _add_url(current)
    current.set_defaults(func=_cmd_current)

    check = sub.add_parser("check", help="exit 1 unless the database is at head with every append-only guard")
    _add_url(check)
    check.set_defaults(func=_cmd_check)


def _cmd_upgrade(args: argparse.Namespace) -> int:
    url = _url(args)
    revision = upgrade(url, args.revision)
    print(f"{display_url(url)}: at revision {revision} (head {head_revision()})")
    return 0


def _cmd_current(args: argparse.Namespace) -> int:
    url = _url(args)
    with unavailable_as_error(url):
        engine = make_engine(url)
        try:
            revision = current_revision(engine)
        finally:
            engine.dispose()
    print(f"{revision or 'none (no audit schema)'} (head {head_revision()})")
    return 0


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
