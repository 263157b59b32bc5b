"""`audit verify --checkpoint NOTE`: the log verifies, and its tree extends a signed (and cosigned) checkpoint held elsewhere."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TextIO

from sqlalchemy import Connection

from loraledger.errors import AuditCorruptError, ConfigError
from loraledger.evidence import node_store, signed_note
from loraledger.evidence.tlog_checkpoint import Checkpoint, open_checkpoint
from loraledger.evidence.witness import check_cosigned

MAX_NOTE_BYTES = 1 << 20


def is_note(path: str) -> bool:
    """A signed note (text), not a JSON chain checkpoint."""
    try:
        with open(path, "rb") as f:
            head = f.read(64).lstrip()
    except OSError:
        return False  # read_checkpoint reports it
    return bool(head) and not head.startswith(b"{")


def extends(conn: Connection, checkpoint: Checkpoint) -> str | None:
    """None when the log's tree, at the checkpoint's size, has the checkpoint's root; else what is wrong."""
    size = node_store.size(conn)
    if size < checkpoint.size:
        return f"the log has {size} events but the checkpoint has {checkpoint.size}: events were removed"
    try:
        root = node_store.root(conn, checkpoint.size)
    except AuditCorruptError as exc:
        return str(exc)
    if root != checkpoint.root:
        return f"the log's first {checkpoint.size} events are not the ones the checkpoint signed: the log was rewritten"
    return None


def verify_command(args: argparse.Namespace, out: TextIO) -> int:
    from loraledger.audit.audit_cli import format_verify
    from loraledger.audit.log import AuditLog

    if args.log_key is None:
        raise ConfigError("a signed checkpoint is checked against the log's key: pass --log-key VKEY")
    log = signed_note.parse_vkey(args.log_key)
    try:
        note = Path(args.checkpoint).read_bytes()[: MAX_NOTE_BYTES + 1]
    except OSError as exc:
        raise ConfigError(f"cannot read checkpoint file {args.checkpoint}: {exc.strerror}") from None
    witnesses = [signed_note.parse_vkey(w) for w in args.witness]
    checkpoint = check_cosigned(note, log, witnesses) if witnesses else open_checkpoint(note, log)[0]
    with AuditLog(args.url) as audit:
        result = audit.verify()
        with audit.snapshot() as conn:
            problem = extends(conn, checkpoint)
    out.write(format_verify(result))
    if problem is not None:
        out.write(f"FAILED against the checkpoint {args.checkpoint}: {problem}\n")
        return 1
    cosigned = f", cosigned by {len(witnesses)} trusted witness(es)" if witnesses else ""
    out.write(
        f"checkpoint {args.checkpoint}: the log's tree extends its {checkpoint.size} leaves unchanged{cosigned}\n"
    )
    return 0 if result.ok else 1
