"""`loraledger audit erase`: the command line of audit/erase.py."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from loraledger.audit.retention import DEFAULT_KEEP_DAYS

_HELP = "make the prompt and completion text of some requests unrecoverable, on record, while verify still passes"


def register(sub: Any, command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command(sub, "erase", _HELP, _erase)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--tenant", help="every request of this tenant (default: none; one of the three is required)")
    which.add_argument(
        "--request",
        metavar="AUDIT_KEY",
        help="this one request, by its audit key (default: none; one of the three is required)",
    )
    which.add_argument(
        "--before", metavar="DATE",
        help="every request received before this ISO-8601 time (UTC if no offset); refused inside the minimum retention "
        "(default: none; one of the three is required)",
    )  # fmt: skip
    p.add_argument("--reason", help="why, recorded in the erased event (default: none; required with --force)")
    p.add_argument(
        "--force", action="store_true",
        help="let --before reach inside the minimum retention; needs --reason (default: refuse)",
    )  # fmt: skip
    p.add_argument("--by", help="who erases, recorded in the event (default: the OS user @ this host)")
    p.add_argument(
        "--keep-days", type=int, default=DEFAULT_KEEP_DAYS,
        help=f"the minimum retention in days, as `audit retention` (default {DEFAULT_KEEP_DAYS}: six months)",
    )  # fmt: skip


def _erase(args: argparse.Namespace) -> int:
    from loraledger.audit.erase import erase
    from loraledger.audit.log import AuditLog
    from loraledger.audit.timefmt import to_unix
    from loraledger.store.db import write_transaction

    before = to_unix(args.before, what="--before")
    with AuditLog(args.url).open() as log, write_transaction(log.engine) as conn:
        done = erase(conn, tenant=args.tenant, request_id=args.request, before=before, reason=args.reason,
                     force=args.force, by=args.by, keep_days=args.keep_days)  # fmt: skip
    out = sys.stdout
    if done.seq is None:
        out.write("nothing to erase: no matching request has text on record that is not erased already\n")
    else:
        out.write(f"erased the text of {done.requests} request(s): {done.prompts} prompt(s), {done.completions} "
                  f"completion(s), {done.text_rows} text row(s) deleted; erased event at seq {done.seq}\n")  # fmt: skip
    if done.kept_inline:
        out.write(f"{done.kept_inline} matching request(s) were written before salted text (revision 0013): their text "
                  "is in rows the chain covers and stays\n")  # fmt: skip
    return 0
