"""The `loraledger` command: demo, generate, and the `db` / `audit` command groups."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# each module exposes register(subparsers) and sets args.func on its parsers
COMMAND_MODULES = (
    "loraledger.commands",  # demo, generate
    "loraledger.store.commands",  # db upgrade / current / check
    "loraledger.audit.commands",  # audit show / requests / usage / verify / report / verify-report
)


def default_url() -> str:
    """--url default: $LORALEDGER_AUDIT_URL, else the engine's default SQLite file."""
    from loraledger.paths import default_audit_url

    return os.environ.get("LORALEDGER_AUDIT_URL") or default_audit_url()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraledger", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from loraledger.errors import LoraLedgerError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except LoraLedgerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
