"""The evidence commands under `loraledger audit`: receipt, verify-receipt, sign-checkpoint, prove, witness, retention, vkey."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from loraledger.errors import ConfigError, EvidenceError
from loraledger.evidence import cosignature, log_tree, node_store, receipt, receipt_store, signed_note
from loraledger.evidence.log_key import LogKey
from loraledger.evidence.log_sources import open_source
from loraledger.evidence.proofs import InclusionProof, check_inclusion
from loraledger.evidence.signed_note import Verifier
from loraledger.evidence.tlog_checkpoint import open_checkpoint
from loraledger.evidence.witness import Witness, check_cosigned

MAX_TEXT_BYTES = 64 << 20


def register(sub: Any, command: Callable[..., argparse.ArgumentParser]) -> None:
    """Add the commands to `loraledger audit` (command: audit's own helper, which adds --url)."""
    p = command(sub, "receipt", "print the signed receipt of a finished request, as its caller received it", _receipt)
    p.add_argument("audit_key", metavar="AUDIT_KEY", help="the request's audit key (RequestOutput.audit_id)")

    p = sub.add_parser(
        "verify-receipt",
        help="check a receipt: its signature, the text it covers, and that its entry is in the log",
        description="check a receipt: its signature, the text it covers, and (with --log, or --checkpoint and --proof) "
        "that its entry is in the log's tree; no database needed with --checkpoint and --proof",
    )
    p.add_argument("file", metavar="FILE", help="the receipt (JSON)")
    p.add_argument(
        "--text",
        metavar="FILE",
        help="a completion's text, which must be one the receipt covers (default: the text is not checked)",
    )
    p.add_argument(
        "--log-key", metavar="VKEY", help="the log's verifier key to trust (default: the one the receipt names)"
    )
    p.add_argument(
        "--checkpoint",
        metavar="FILE",
        help="a signed (and cosigned) checkpoint to prove the entry against (default: fetched with --log)",
    )
    p.add_argument(
        "--witness",
        metavar="VKEY",
        action="append",
        default=[],
        help="a witness whose cosignature the checkpoint needs (repeatable; default: none)",
    )
    p.add_argument(
        "--proof",
        metavar="FILE",
        help="the inclusion proof (JSON, from `audit prove` or GET /evidence/proof/inclusion; default: fetched with --log)",
    )
    p.add_argument(
        "--log",
        metavar="URL",
        help="the log (database URL, or the server's http(s) URL) to fetch the checkpoint and proof from (default: none)",
    )
    p.add_argument("--api-key", help="the server's API key, where it has keys (default: none)")
    p.set_defaults(func=_verify_receipt)

    p = command(
        sub,
        "sign-checkpoint",
        "sign a checkpoint of the log's Merkle tree (C2SP format) and keep it in `checkpoints`",
        _sign,
    )
    p.add_argument(
        "--key", metavar="PEM", help="the log's key (default: $LORALEDGER_LOG_KEY, else the engine's default key)"
    )
    p.add_argument("--out", metavar="FILE", help="also write the signed note to FILE (default: stdout only)")

    p = command(sub, "prove", "an inclusion proof (--leaf) or a consistency proof (--old), as JSON", _prove)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--leaf",
        type=int,
        help="leaf index (event seq - 1; a receipt's leaf_index; default: none, one of --leaf / --old is required)",
    )
    which.add_argument(
        "--old",
        type=int,
        help="the older tree size a consistency proof starts from (default: none, one of --leaf / --old is required)",
    )
    p.add_argument("--size", type=int, help="the tree size to prove against (default: the log's)")

    p = sub.add_parser(
        "witness",
        help="cosign the log's latest checkpoint if the log only grew since the last one this witness cosigned",
        description="a C2SP tlog-witness: fetches the log's latest signed checkpoint, checks a consistency proof from "
        "the last checkpoint it cosigned (kept in --state), and cosigns (cosignature/v1) only if the log only grew",
    )
    p.add_argument("--log", required=True, metavar="URL", help="the log: its database URL, or its server's http(s) URL")
    p.add_argument("--log-key", required=True, metavar="VKEY", help="the log's verifier key (`loraledger audit vkey`)")
    p.add_argument("--key", required=True, metavar="PEM", help="this witness's Ed25519 key (`loraledger audit keygen`)")
    p.add_argument("--name", required=True, help="this witness's name, e.g. witness.example.com/w1")
    p.add_argument("--state", required=True, metavar="FILE", help="the witness's state file (made on first use)")
    p.add_argument("--out", metavar="FILE", help="also write the cosigned checkpoint to FILE (default: stdout only)")
    p.add_argument("--api-key", help="the server's API key, where it has keys (default: none)")
    p.set_defaults(func=_witness)

    p = command(sub, "retention", "what the log holds that is older than the minimum retention, per tenant", _retention)
    p.add_argument("--keep-days", type=int, default=183, help="the minimum retention in days (default 183: six months)")
    p.add_argument("--format", choices=("text", "json"), default="text", help="text for people, json for programs")

    p = sub.add_parser(
        "vkey",
        help="print the verifier key (C2SP vkey) of a log or witness key",
        description="print the verifier key (C2SP vkey) of a log key, or with --witness NAME of a witness key",
    )
    p.add_argument("--key", metavar="PEM", help="the key (default: the log's, as sign-checkpoint finds it)")
    p.add_argument(
        "--witness",
        metavar="NAME",
        help="print the cosignature/v1 vkey of a witness of this name (default: the log key's vkey)",
    )
    p.set_defaults(func=_vkey)


def _log(args: argparse.Namespace) -> Any:
    from loraledger.audit.log import AuditLog

    return AuditLog(args.url).open()


def _receipt(args: argparse.Namespace) -> int:
    with _log(args) as log, log.snapshot() as conn:
        found = receipt_store.stored(conn, args.audit_key)
    if found is None:
        raise EvidenceError(
            f"no receipt for audit key {args.audit_key!r}: it is not a finished request of this log, or it finished "
            "before receipts were issued (revision 0010) or without a log key"
        )
    sys.stdout.buffer.write(receipt.dumps(found))
    return 0


def _read(path: str, what: str, limit: int = 1 << 20) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    if len(data) > limit:
        raise ConfigError(f"{what} {path} is larger than {limit} bytes")
    return data


def _verifier(vkey: str | None) -> Verifier | None:
    return None if vkey is None else signed_note.parse_vkey(vkey)


def _verify_receipt(args: argparse.Namespace) -> int:
    out = sys.stdout
    held = receipt.load(_read(args.file, "receipt"))
    trusted = _verifier(args.log_key)
    body = receipt.check_signature(held, trusted)
    log = trusted or signed_note.parse_vkey(held.log_key)
    out.write(
        f"signature OK: signed by {log.vkey()}"
        + ("" if trusted else " (the key the receipt names; pass --log-key to pin it)")
        + "\n"
    )
    out.write(f"  audit key {body['audit_key']}, adapter {body.get('adapter_fingerprint') or 'none (base model)'}, "
              f"base model {body.get('base_model_fingerprint')}, event seq {body['seq']}\n")  # fmt: skip
    if args.text is not None:
        text = _read(args.text, "text file", MAX_TEXT_BYTES).decode("utf-8", errors="strict")
        index = receipt.matching_completion(body, text)
        if index is None:
            out.write(f"FAILED: the text in {args.text} is none of the receipt's completions\n")
            return 1
        out.write(f"text OK: {args.text} is completion {index}\n")
    if args.checkpoint is None and args.log is None:
        out.write("inclusion not checked: pass --log, or --checkpoint and --proof\n")
        return 0
    witnesses = [signed_note.parse_vkey(w) for w in args.witness]
    source = open_source(args.log, args.api_key) if args.log is not None else None
    with source if source is not None else _Nothing():
        note = _read(args.checkpoint, "checkpoint") if args.checkpoint is not None else _fetched_note(source)
        checkpoint = check_cosigned(note, log, witnesses) if witnesses else open_checkpoint(note, log)[0]
        if args.proof is not None:
            proof = _decode(_read(args.proof, "proof"), InclusionProof)
        elif source is not None:
            proof = source.inclusion(body["leaf_index"], checkpoint.size)
        else:
            raise ConfigError("pass --proof (or --log to fetch one) with --checkpoint")
    check_inclusion(node_store.leaf_of_event(body["event_hash"]), proof, checkpoint)
    cosigned = f", cosigned by {len(witnesses)} witness(es)" if witnesses else ""
    out.write(f"inclusion OK: leaf {body['leaf_index']} is in the checkpoint of {checkpoint.size} leaves{cosigned}\n")
    return 0


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        pass


def _fetched_note(source: Any) -> bytes:
    return source.checkpoint().encode()


def _decode(data: bytes, kind: Any) -> Any:
    try:
        return msgspec.json.decode(data, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise EvidenceError(f"not a {kind.__name__}: {exc}") from None


def _sign(args: argparse.Namespace) -> int:
    from loraledger.store.db import write_transaction

    key = LogKey.load(args.key)
    with _log(args) as log, write_transaction(log.engine) as conn:
        note = log_tree.sign_checkpoint(conn, key)
    if args.out:
        Path(args.out).write_text(note)
    sys.stdout.write(note)
    return 0


def _prove(args: argparse.Namespace) -> int:
    with _log(args) as log, log.snapshot() as conn:
        if args.leaf is not None:
            proof: Any = log_tree.inclusion(conn, args.leaf, args.size)
        else:
            proof = log_tree.consistency(conn, args.old, args.size)
    sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(proof), indent=2) + b"\n")
    return 0


def _witness(args: argparse.Namespace) -> int:
    from loraledger.audit.signing import load_private_key

    witness = Witness(args.name, load_private_key(args.key), args.state)
    log = signed_note.parse_vkey(args.log_key)
    with open_source(args.log, args.api_key) as source:
        cosigned = witness.cosign(source.checkpoint(), log, source.consistency)
    if args.out:
        Path(args.out).write_text(cosigned)
    sys.stdout.write(cosigned)
    return 0


def _vkey(args: argparse.Namespace) -> int:
    if args.witness is not None:
        from loraledger.audit.signing import load_private_key

        if args.key is None:
            raise ConfigError("--witness needs --key, the witness's PEM key")
        sys.stdout.write(cosignature.verifier_for(args.witness, load_private_key(args.key)).vkey() + "\n")
        return 0
    sys.stdout.write(LogKey.load(args.key).verifier.vkey() + "\n")
    return 0


def _retention(args: argparse.Namespace) -> int:
    from loraledger.audit.retention import retention_report
    from loraledger.audit.timefmt import iso

    with _log(args) as log, log.snapshot() as conn:
        report = retention_report(conn, args.keep_days)
    if args.format == "json":
        sys.stdout.buffer.write(msgspec.json.encode({**msgspec.to_builtins(report), "total": report.total}) + b"\n")
        return 0
    out = sys.stdout
    out.write(
        f"minimum retention {report.keep_days} days: {report.total} request(s) received before {iso(report.cutoff)}\n"
    )
    for t in report.past:
        out.write(f"  tenant {t.tenant or '-'}: {t.requests} requests, {t.completions} completions, "
                  f"{t.prompts_with_text} prompts kept as text, oldest {iso(t.oldest)}\n")  # fmt: skip
    out.write("`loraledger audit erase --before DATE` erases their text; the log still verifies (EVIDENCE.md)\n")
    return 0
