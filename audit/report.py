"""Compliance report export: a signed bundle of manifest.json, requests and completions files, and report.html.

Everything is read in one snapshot of the log and streamed to disk; only per-adapter, per-tenant
and per-day counters are kept in memory, so a report of any size exports in bounded memory.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from loraledger.audit import queries as q
from loraledger.audit.export import check_format
from loraledger.audit.html import render_report_html
from loraledger.audit.log import AuditLog, adapter_info
from loraledger.audit.progress import Progress
from loraledger.audit.report_rows import Tally, export_rows
from loraledger.audit.report_sources import adapter_source, model_sources
from loraledger.audit.results import ExportedFile, VerifyResult
from loraledger.audit.signing import UNSIGNED, Signature, Signer, signer_for
from loraledger.audit.timefmt import Instant, iso, to_unix
from loraledger.audit.verify import verify_log
from loraledger.digests import bytes_sha256, file_sha256, report_signed_message
from loraledger.errors import AuditCorruptError, ConfigError, LoraLedgerError
from loraledger.store.db import display_url
from loraledger.store.records import Checkpoint
from loraledger.version import __version__

REPORT_FORMAT = "loraledger-audit-report/1"
MANIFEST = "manifest.json"
HTML = "report.html"


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    """The one byte form of manifest.json: any other layout of the same content is an edit."""
    return (json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode()


def write_report(
    log: AuditLog,
    out: Path | str,
    *,
    since: Instant,
    until: Instant,
    adapter: str | None = None,
    tenant: str | None = None,
    instance: str | None = None,
    previous: Path | str | None = None,
    fmt: str = "csv",
    unsigned: bool = False,
    key_file: Path | str | None = None,
    progress: bool = True,
    env: Mapping[str, str] = os.environ,
) -> dict[str, Any]:
    """Export the requests received in [since, until) (and matching adapter / tenant / engine instance) to the bundle out;
    returns the manifest.

    Signed with key_file (Ed25519) or $LORALEDGER_REPORT_KEY (HMAC-SHA256); refuses to write an
    unsigned bundle unless unsigned=True. previous: an earlier bundle, whose manifest digest is
    recorded and whose chain head the log must still contain unchanged.
    """
    fmt = check_format(fmt)
    signer = signer_for(key_file, unsigned=unsigned, env=env)
    lo, hi = to_unix(since, what="since"), to_unix(until, what="until")
    if lo is None or hi is None or hi <= lo:
        raise ConfigError(f"a report needs a window with since < until, got since={since!r} until={until!r}")
    flt = q.RequestFilter(adapter=adapter, tenant=tenant, instance=instance, since=lo, until=hi)
    previous_info, previous_head = _previous(previous)
    out = Path(out)
    created = _prepare_dir(out)
    try:
        return _write_bundle(log, out, flt, fmt, signer, previous_info, previous_head, progress)
    except BaseException:
        _remove_partial(out, created)
        raise


def _write_bundle(
    log: AuditLog,
    out: Path,
    flt: q.RequestFilter,
    fmt: str,
    signer: Signer | None,
    previous_info: dict[str, Any] | None,
    previous_head: Checkpoint | None,
    progress: bool,
) -> dict[str, Any]:
    with log.snapshot() as conn:
        head = q.head(conn)
        with Progress("verifying the audit log", head.sequence if head else 0, enabled=progress) as bar:
            verification = verify_log(conn, previous_head, on_event=bar.advance)
        tally = Tally()
        try:
            with Progress("exporting requests", q.count_requests(conn, flt), enabled=progress) as bar:
                files = export_rows(conn, flt, out, fmt, tally, bar)
            first_seq, last_seq = conn.execute(q.events_window(flt)).one()
            fingerprints = [fp for fp in tally.by_adapter if fp is not None]
            adapters = [adapter_info(row) for row in q.stream(conn, q.adapters_statement(fingerprints))]
            models = model_sources(conn, flt)
        except (TypeError, ValueError, AttributeError) as exc:
            first = verification.first_problem
            if first is None or isinstance(exc, LoraLedgerError):
                raise  # the log verified: not a malformed row
            raise AuditCorruptError(
                f"the audit log holds values the report cannot export ({type(exc).__name__}: {exc}); it did not verify: "
                f"{verification.problem_count} problem(s), the first at sequence {first.sequence}: {first.message}"
            ) from exc

    manifest: dict[str, Any] = {
        "format": REPORT_FORMAT,
        "generated_at": iso(dt.datetime.now(dt.timezone.utc).timestamp()),
        "engine_version": __version__,
        "database": display_url(log.url),
        "window": {"since": iso(flt.since), "until": iso(flt.until)},
        "filters": {"adapter": flt.adapter, "tenant": flt.tenant, "instance": flt.instance},
        "row_format": fmt,
        "counts": tally.counts(),
        "sequence": {"first": first_seq, "last": last_seq},
        "chain_head": msgspec.to_builtins(head) if head else None,
        "verification": _verification(verification, previous_head),
        "previous": previous_info,
        "files": [msgspec.to_builtins(f) for f in files],
        # where the base model, tokenizer and adapters of the exported requests were read from (Hub commits)
        "sources": {"instances": models, "adapters": [adapter_source(a.record) for a in adapters]},
    }
    html_path = out / HTML
    # the page names the signature's scheme and key; the signature then covers the page through its sha256
    signing = msgspec.to_builtins(signer.identity() if signer else Signature(algorithm=UNSIGNED))
    html_path.write_text(render_report_html(manifest, adapters, tally.daily_usage(), signing), encoding="utf-8")
    html_file = ExportedFile(name=HTML, rows=None, bytes=html_path.stat().st_size, sha256=file_sha256(html_path))
    manifest["files"].append(msgspec.to_builtins(html_file))
    signature = signer.sign(report_signed_message(manifest)) if signer else Signature(algorithm=UNSIGNED)
    manifest["signature"] = msgspec.to_builtins(signature)
    (out / MANIFEST).write_bytes(manifest_bytes(manifest))
    return manifest


def _prepare_dir(out: Path) -> bool:
    """Make out ready for a bundle; True when it had to be created."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    if out.is_dir():
        if any(out.iterdir()):
            raise ConfigError(f"--out {out} is not empty: a report is written into a new (or empty) directory")
        return False
    out.mkdir(parents=True)
    return True


def _remove_partial(out: Path, created: bool) -> None:
    """A failed export leaves no half bundle behind (out was empty before it started)."""
    for path in out.iterdir():
        if path.is_file():
            path.unlink()
    if created and not any(out.iterdir()):
        out.rmdir()


def _previous(previous: Path | str | None) -> tuple[dict[str, Any] | None, Checkpoint | None]:
    if previous is None:
        return None, None
    path = Path(previous) / MANIFEST
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--previous {previous}: cannot read {path}: {exc.strerror}") from None
    try:
        head = json.loads(data).get("chain_head")
        checkpoint = None if head is None else msgspec.convert(head, Checkpoint)
    except (json.JSONDecodeError, AttributeError, msgspec.ValidationError):
        raise ConfigError(f"--previous {previous}: {path} is not a loraledger report manifest") from None
    info = {"manifest_sha256": bytes_sha256(data), "chain_head": head}
    return info, checkpoint


def _verification(result: VerifyResult, checkpoint: Checkpoint | None) -> dict[str, Any]:
    first = result.first_problem
    return {
        "ok": result.ok,
        "events": result.events,
        "head": msgspec.to_builtins(result.head) if result.head else None,
        "checked_against_previous": checkpoint is not None,
        "first_bad_sequence": first.sequence if first else None,
        "problem": first.message if first else None,
        "problem_count": result.problem_count,
    }
