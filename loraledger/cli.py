"""The `loraledger` command: demo, generate, and the `db` / `audit` command groups."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# each module exposes register(subparsers) and sets args.func on its parsers
COMMAND_MODULES = (
    "loraledger.demo.command",  # demo
    "loraledger.generate_command",  # generate
    "loraledger.store.db_cli",  # db upgrade / current / check
    "loraledger.audit.audit_cli",  # audit show / requests / usage / verify / report / verify-report
    "loraledger.server.serve_cli",  # serve, keys add / list
)
LOG_LEVELS = ("debug", "info", "warning", "error")


class HelpFormatter(argparse.HelpFormatter):
    """One-line helps that end with their default, where the option has one and the help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default is argparse.SUPPRESS  # identity: 0 and 0.0 are defaults
        if "default" in text or action.required or unset or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """Every parser of the command, subcommands included (add_subparsers makes its children of this class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def show_help(parser: argparse.ArgumentParser):
    """A command group's func: run without a subcommand, the group prints its help."""

    def run(_args: argparse.Namespace) -> int:
        parser.print_help()
        return 0

    return run


def default_url() -> str:
    """--url default: $LORALEDGER_AUDIT_URL, else the engine's default SQLite file."""
    from loraledger.paths import default_audit_url

    return os.environ.get("LORALEDGER_AUDIT_URL") or default_audit_url()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="loraledger", description=__doc__)
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default=None,
        help="the engine's own log lines, on stdout (default: $LORALEDGER_LOG_LEVEL, else error)",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    parser.set_defaults(func=show_help(parser))
    return parser


def main(argv: list[str] | None = None) -> int:
    from loraledger.errors import LoraLedgerError
    from loraledger.logging import configure

    args = build_parser().parse_args(argv)
    # a command prints each error it raises once, itself: the engine's warnings would say it twice
    # (serve logs JSON lines of its own, configured by the command)
    if not getattr(args, "json_logs", False):
        configure(args.log_level or os.environ.get("LORALEDGER_LOG_LEVEL") or "error")
    try:
        return int(args.func(args) or 0)
    except LoraLedgerError as exc:
        # one string argument, printed as is (KeyError subclasses would print its repr)
        message = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
