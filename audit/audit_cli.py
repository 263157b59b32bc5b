"""The `loraledger audit ...` commands: show, requests, usage, adapters, instances, verify, checkpoint, report, verify-report, keygen
(and the evidence commands of loraledger/evidence/evidence_cli.py)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from loraledger.audit.lineage_text import format_lineage
from loraledger.audit.listing_output import emit
from loraledger.audit.log import AuditLog
from loraledger.audit.results import AdapterInfo, Problem, RequestRow, VerifyResult
from loraledger.audit.timefmt import iso
from loraledger.errors import ConfigError
from loraledger.store.instances import SOURCE_FIELDS, LeaseState
from loraledger.store.records import AdapterRecord

LISTING_FORMATS = ("table", "csv", "jsonl")
SHOWN_PROBLEMS = 10


def register(subparsers: argparse._SubParsersAction) -> None:
    from loraledger.cli import show_help

    audit = subparsers.add_parser("audit", help="query, verify and export the audit log", description=__doc__)
    sub = audit.add_subparsers(dest="audit_command", title="commands", metavar="COMMAND")
    audit.set_defaults(func=show_help(audit))

    p = _command(sub, "show", "the full lineage of one request: binding, prompt, adapter, completions, events", _show)
    p.add_argument(
        "request_id", metavar="REQUEST_ID",
        help="the request's audit key (RequestOutput.audit_id; it always wins), or else the caller's own request id "
        "(every request that used it is shown) or a unique prefix of an audit key (4 characters or more)",
    )  # fmt: skip
    p.add_argument(
        "--caller-id", action="store_true",
        help="take REQUEST_ID as a caller's own request id only (default: an exact audit key wins, then caller ids and "
        "key prefixes; both matching is an error listing them)",
    )  # fmt: skip
    p.add_argument("--format", choices=("text", "json"), default="text", help="text for people, json for programs")

    p = _command(sub, "requests", "list requests (received order)", _requests)
    _filters(p)
    p.add_argument(
        "--finish-reason",
        choices=("stop", "length", "abort"),
        help="only requests with a completion that ended so (default: any)",
    )
    p.add_argument("--limit", type=int, help="at most this many rows (default: all)")
    _listing_format(p)

    p = _command(
        sub, "usage", "requests, prompt / generated tokens and failed requests per adapter, tenant, day", _usage
    )
    p.add_argument("--by", default="adapter,tenant,day", help="comma-separated keys out of adapter,tenant,day")
    _filters(p)
    _listing_format(p)

    p = _command(sub, "adapters", "the adapter inventory with fingerprints and first / last use", _adapters)
    _listing_format(p)

    p = _command(
        sub,
        "instances",
        "the engine instances that write this log, with their leases (live, expired, stopped, recovered)",
        _instances,
    )
    _listing_format(p)

    p = _command(sub, "verify", "recompute the hash chain and check every binding and completion", _verify)
    p.add_argument(
        "--checkpoint", metavar="FILE",
        help="a checkpoint (or report manifest.json) the log must extend unchanged, or a signed (cosigned) checkpoint "
        "note whose tree the log's must extend (default: none, the log alone)",
    )  # fmt: skip
    p.add_argument(
        "--log-key",
        metavar="VKEY",
        help="with a signed checkpoint: the log's verifier key to trust (default: none; required with a note)",
    )
    p.add_argument(
        "--witness", metavar="VKEY", action="append", default=[],
        help="with a signed checkpoint: a witness whose valid cosignature it must carry (repeatable; default: none)",
    )  # fmt: skip

    p = _command(sub, "checkpoint", "write the current head of the event chain to a file", _checkpoint)
    p.add_argument("--out", required=True, metavar="FILE", help="the checkpoint file to write (JSON)")

    p = _command(sub, "report", "export a signed compliance report bundle", _report)
    p.add_argument("--since", required=True, help="ISO-8601 time (UTC if no offset), inclusive")
    p.add_argument("--until", required=True, help="ISO-8601 time (UTC if no offset), exclusive")
    p.add_argument(
        "--adapter", help="adapter fingerprint or the lora_name requests were submitted with (default: every adapter)"
    )
    p.add_argument("--tenant", help="only this tenant's requests (default: every tenant)")
    p.add_argument("--instance", help="only the requests this engine instance admitted (default: every instance)")
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty directory")
    p.add_argument(
        "--previous", metavar="DIR", help="the previous report bundle: chains this report to it (default: none)"
    )
    p.add_argument("--format", choices=("csv", "jsonl"), default="csv", help="row file format")
    p.add_argument(
        "--key-file", metavar="PEM", help="Ed25519 private key (default: HMAC-SHA256 with $LORALEDGER_REPORT_KEY)"
    )
    p.add_argument(
        "--unsigned", action="store_true", help="write the report even with no signing key (default: refuse)"
    )

    text = "check a report bundle's signature, file hashes and counts"
    p = sub.add_parser("verify-report", help=text, description=text)
    p.add_argument("directory", metavar="DIR", help="the report bundle (the folder holding manifest.json)")
    p.add_argument(
        "--key-file", metavar="PEM",
        help="the Ed25519 public key of an Ed25519-signed report (default: none; HMAC reports use $LORALEDGER_REPORT_KEY)",
    )  # fmt: skip
    p.add_argument("--previous", metavar="DIR", help="the report this one claims to follow (default: none)")
    p.add_argument(
        "--allow-unsigned", action="store_true", help="accept a report written with --unsigned (default: refuse)"
    )
    p.set_defaults(func=_verify_report)

    text = "write a new Ed25519 key pair for signing reports"
    p = sub.add_parser("keygen", help=text, description=text)
    p.add_argument("--out", required=True, metavar="PEM", help="private key file (created with mode 0600)")
    p.add_argument("--public", metavar="PEM", help="public key file, for verify-report (default: not written)")
    p.set_defaults(func=_keygen)

    from loraledger.evidence import evidence_cli as evidence

    evidence.register(sub, _command)  # receipt, verify-receipt, sign-checkpoint, prove, witness, vkey
    from loraledger.audit import erase_command

    erase_command.register(sub, _command)


def _command(sub: Any, name: str, help_text: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    from loraledger.paths import default_audit_url

    p = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument(
        "--url", default=None, help=f"audit database URL (default: $LORALEDGER_AUDIT_URL, else {default_audit_url()})"
    )
    p.set_defaults(func=_pipe_safe(func))
    return p


def _listing_format(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--format", choices=LISTING_FORMATS, default="table", help="a table for people, csv or JSON lines for programs"
    )


def _pipe_safe(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A listing piped into `head` stops quietly when the reader goes away."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except BrokenPipeError:
            # the interpreter flushes stdout at exit: point it somewhere that still accepts writes
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0

    return run


def _filters(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--adapter", help="adapter fingerprint or the lora_name requests were submitted with (default: every adapter)"
    )
    p.add_argument("--tenant", help="only this tenant's requests (default: every tenant)")
    p.add_argument(
        "--instance",
        help="only the requests this engine instance admitted (see `audit instances`; default: every instance)",
    )
    p.add_argument("--since", help="ISO-8601 time (UTC if no offset), inclusive (default: the first request)")
    p.add_argument("--until", help="ISO-8601 time (UTC if no offset), exclusive (default: now)")


def _open(args: argparse.Namespace) -> AuditLog:
    return AuditLog(args.url).open()


# -- listings ------------------------------------------------------------------------------


def _requests(args: argparse.Namespace) -> int:
    out = sys.stdout
    table = (
        ("request_id", "request", 36), ("caller_request_id", "caller id", 10), ("received_at", "received (UTC)", 20), ("tenant", "tenant", 12),
        ("lora_name", "adapter", 16), ("adapter_fingerprint", "fingerprint", 12), ("status", "status", 11),
        ("num_completions", "n", 2), ("prompt_token_count", "prompt", 7), ("generated_tokens", "generated", 9),
        ("finish_reasons", "finish", 12), ("instance_id", "instance", 12),
    )  # fmt: skip
    with _open(args) as log:
        rows = log.requests(
            adapter=args.adapter, tenant=args.tenant, since=args.since, until=args.until,
            finish_reason=args.finish_reason, limit=args.limit, instance=args.instance,
        )  # fmt: skip
        emit(rows, table, RequestRow.__struct_fields__, args.format, out, _request_cells)
    return 0


def _request_cells(row: RequestRow) -> dict[str, Any]:
    cells = msgspec.to_builtins(row)
    cells["received_at"] = iso(row.received_at)
    cells["finished_at"] = iso(row.finished_at)
    return cells


def _usage(args: argparse.Namespace) -> int:
    out = sys.stdout
    group_by = tuple(key.strip() for key in args.by.split(",") if key.strip())
    table: list[tuple[str, str, int]] = [("day", "day (UTC)", 10)] if "day" in group_by else []
    fields = ["day"] if "day" in group_by else []
    if "adapter" in group_by:
        table += [("lora_name", "adapter", 16), ("adapter_fingerprint", "fingerprint", 12)]
        fields += ["lora_name", "adapter_fingerprint"]
    if "tenant" in group_by:
        table.append(("tenant", "tenant", 12))
        fields.append("tenant")
    metrics = (("requests", "requests", 9), ("prompt_tokens", "prompt tokens", 13),
               ("generated_tokens", "generated tokens", 16), ("errors", "errors", 7))  # fmt: skip
    table += metrics
    fields += [name for name, _, _ in metrics]
    with _open(args) as log:
        rows = log.usage(
            group_by=group_by,
            since=args.since,
            until=args.until,
            adapter=args.adapter,
            tenant=args.tenant,
            instance=args.instance,
        )
        emit(rows, table, fields, args.format, out, msgspec.to_builtins)
    return 0


def _adapters(args: argparse.Namespace) -> int:
    out = sys.stdout
    table = (
        ("name", "name", 16), ("fingerprint", "fingerprint", 64), ("rank", "rank", 4), ("alpha", "alpha", 6),
        ("repo_id", "hub repo", 24), ("commit_sha", "commit", 40), ("requests", "requests", 9), ("first_used", "first used (UTC)", 20), ("last_used", "last used (UTC)", 20),
    )  # fmt: skip
    fields = (*AdapterRecord.__struct_fields__, "requests", "first_used", "last_used")
    with _open(args) as log:
        emit(log.adapters(), table, fields, args.format, out, _adapter_cells)
    return 0


def _adapter_cells(info: AdapterInfo) -> dict[str, Any]:
    cells = msgspec.to_builtins(info.record)
    cells["first_seen"] = iso(info.record.first_seen)
    cells.update(requests=info.requests, first_used=iso(info.first_used), last_used=iso(info.last_used))
    return cells


def _instances(args: argparse.Namespace) -> int:
    table = (
        ("instance_id", "instance", 33), ("host", "host", 16), ("pid", "pid", 7), ("engine_version", "version", 7),
        ("started_at", "started (UTC)", 20), ("state", "lease", 9), ("expires_at", "lease ends (UTC)", 20),
        ("recovered_by", "recovered by", 33), ("model", "model", 24), ("model_commit_sha", "model commit", 40),
        ("quantization", "quantization", 24),
    )  # fmt: skip
    fields = (
        "instance_id",
        "host",
        "pid",
        "engine_version",
        "started_at",
        "lease_seconds",
        "state",
        "expires_at",
        "recovered_by",
        "recovered_at",
        *SOURCE_FIELDS,
    )
    with _open(args) as log:
        emit(log.instances(), table, fields, args.format, sys.stdout, _instance_cells)
    return 0


def _instance_cells(lease: LeaseState) -> dict[str, Any]:
    cells = msgspec.to_builtins(lease.instance)
    cells["started_at"] = iso(lease.instance.started_at)
    stopped = lease.state == "stopped"  # it ended its own lease: no one recovered it
    cells.update(
        state=lease.state,
        expires_at=iso(lease.expires_at),
        recovered_by=None if stopped else lease.recovered_by,
        recovered_at=None if stopped else iso(lease.recovered_at),
    )
    return cells


# -- one request ---------------------------------------------------------------------------


def _show(args: argparse.Namespace) -> int:
    """One request's lineage; for a caller id that several requests used, each of theirs (a JSON list with --format
    json), oldest first."""
    out = sys.stdout
    from loraledger.audit.log import CALLER_ID, KEY, PREFIX

    with _open(args) as log:
        match = log.match_request(args.request_id, caller_id_only=args.caller_id)
        keys, total = match.keys, match.total
        lineages = [log.request(key) for key in keys]
    if args.format == "json":
        data = lineages[0] if total == 1 else lineages
        out.write(msgspec.json.format(msgspec.json.encode(data), indent=2).decode() + "\n")
        if match.kind != KEY:
            print(f"{args.request_id} matched as a {match.kind}, not an audit key", file=sys.stderr)
        return 0
    # what kind of match this is comes first, so that a caller's chosen id is never mistaken for an audit key
    if match.kind == CALLER_ID:
        more = f"; the first {len(keys)} are shown" if total > len(keys) else ""
        used = f"was used by {total} requests" if total > 1 else "was used by 1 request"
        out.write(
            f"caller request id {args.request_id} {used} (matched as the caller's id, not an audit key){more}\n\n"
        )
    elif match.kind == PREFIX:
        out.write(f"audit key prefix {args.request_id} matches request {keys[0]}\n\n")
    out.write("\n".join(format_lineage(lineage) for lineage in lineages))
    return 0


# -- integrity -----------------------------------------------------------------------------


def _verify(args: argparse.Namespace) -> int:
    out = sys.stdout
    from loraledger.evidence import signed_checkpoint

    if args.checkpoint is not None and signed_checkpoint.is_note(args.checkpoint):
        return signed_checkpoint.verify_command(args, out)
    with _open(args) as log:
        result = log.verify(args.checkpoint)
    out.write(format_verify(result))
    if args.checkpoint is not None and result.ok:
        out.write(format_checkpoint_proof(args.checkpoint, result))
    return 0 if result.ok else 1


def format_checkpoint_proof(path: str, result: VerifyResult) -> str:
    """What a clean verify against a checkpoint proved: the log only grew since the checkpoint was taken."""
    from loraledger.audit.verify import read_checkpoint

    checkpoint = read_checkpoint(path)
    grown = (result.head.sequence - checkpoint.sequence) if result.head is not None else 0
    return (
        f"checkpoint {path}: event {checkpoint.sequence} still has hash {checkpoint.hash}, so the log extends it "
        f"unchanged ({grown} event{'s' if grown != 1 else ''} added since)\n"
    )


def format_verify(result: VerifyResult) -> str:
    head = result.head
    if result.ok:
        if head is None:
            return "OK: the audit log is empty\n"
        return (
            f"OK: {result.events} events, {result.requests} requests, {result.completions} completions verified"
            + (f"; {result.erased_texts} text rows erased, each on record\n" if result.erased_texts else "\n")
            + f"head {head.sequence} {head.hash}\n"
        )
    first = result.first_problem
    assert first is not None
    where = f"sequence {first.sequence}" if first.sequence is not None else "no event"
    lines = [f"FAILED at {where}{_row(first)}: {first.message}"]
    for p in result.problems[1:SHOWN_PROBLEMS]:
        lines.append(f"  also at {p.sequence if p.sequence is not None else '-'}{_row(p)}: {p.message}")
    if result.problem_count > SHOWN_PROBLEMS:
        lines.append(f"  ... {result.problem_count - SHOWN_PROBLEMS} more problems")
    return "\n".join(lines) + "\n"


def _row(problem: Problem) -> str:
    """(`table` row key=value, ...) of a problem that names a row."""
    if problem.table is None:
        return ""
    key = ", ".join(f"{k}={v!r}" for k, v in (problem.key or {}).items())
    return f" (`{problem.table}` row {key})" if key else f" (`{problem.table}`)"


def _checkpoint(args: argparse.Namespace) -> int:
    out = sys.stdout
    from loraledger.audit.verify import write_checkpoint

    with _open(args) as log:
        head = log.head()
    if head is None:
        raise ConfigError("the audit log is empty: there is no head to checkpoint yet")
    write_checkpoint(args.out, head)
    out.write(f"head {head.sequence} {head.hash} written to {args.out}\n")
    return 0


def _report(args: argparse.Namespace) -> int:
    out = sys.stdout
    from loraledger.audit.report import MANIFEST, write_report

    with _open(args) as log:
        manifest = write_report(
            log, args.out, since=args.since, until=args.until, adapter=args.adapter, tenant=args.tenant,
            instance=args.instance, previous=args.previous, fmt=args.format, unsigned=args.unsigned, key_file=args.key_file,
        )  # fmt: skip
    counts, verification = manifest["counts"], manifest["verification"]
    out.write(
        f"report written to {args.out}: {counts['requests']} requests, {counts['completions']} completions, "
        f"signature {manifest['signature']['algorithm']}\n"
    )
    if not verification["ok"]:
        out.write(
            f"WARNING: the audit log did not verify (first bad sequence {verification['first_bad_sequence']}: "
            f"{verification['problem']}); see {MANIFEST}\n"
        )
        return 1
    return 0


def _verify_report(args: argparse.Namespace) -> int:
    out = sys.stdout
    from loraledger.audit.report_verify import verify_report

    check = verify_report(
        args.directory, key_file=args.key_file, previous=args.previous, allow_unsigned=args.allow_unsigned
    )
    if check.ok:
        out.write(f"OK: {args.directory} is intact ({check.signature} signature, file hashes and counts match)\n")
        return 0
    out.write(f"FAILED: {args.directory}\n" + "".join(f"  {p}\n" for p in check.problems))
    return 1


def _keygen(args: argparse.Namespace) -> int:
    out = sys.stdout
    from loraledger.audit.signing import generate_ed25519_key

    generate_ed25519_key(args.out, args.public)
    out.write(
        f"Ed25519 private key written to {args.out}" + (f", public key to {args.public}" if args.public else "") + "\n"
    )
    return 0
