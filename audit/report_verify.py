"""verify-report: check a report bundle's signature, file digests and counts (recounted from the files)."""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from loraledger.audit.export import FORMATS, read_rows
from loraledger.audit.report import HTML, MANIFEST, REPORT_FORMAT, manifest_bytes
from loraledger.audit.report_rows import group_counts, kind_counts, row_files
from loraledger.audit.results import FAILED, ReportCheck
from loraledger.audit.signing import UNSIGNED, Signature, check_signature
from loraledger.digests import file_sha256, report_signed_message


def verify_report(
    directory: Path | str,
    *,
    key_file: Path | str | None = None,
    previous: Path | str | None = None,
    allow_unsigned: bool = False,
    env: Mapping[str, str] = os.environ,
) -> ReportCheck:
    """Every problem found with the bundle in directory; ok only when there is none.

    key_file: the Ed25519 public key (PEM) for an Ed25519-signed bundle; an HMAC-signed bundle is
    checked with $LORALEDGER_REPORT_KEY. previous: the earlier bundle this one says it follows.
    """
    directory = Path(directory)
    problems: list[str] = []
    try:
        raw = (directory / MANIFEST).read_bytes()
    except OSError as exc:
        return ReportCheck(
            ok=False, problems=[f"cannot read {directory / MANIFEST}: {exc.strerror}"], signature="unknown"
        )
    try:
        manifest = json.loads(raw)
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        if manifest_bytes(manifest) != raw:
            problems.append(f"{MANIFEST} is not byte for byte as loraledger writes it: it was edited")
    except (ValueError, UnicodeDecodeError) as exc:
        return ReportCheck(
            ok=False, problems=[f"{MANIFEST} is not a JSON object ({exc}): it was edited"], signature="unknown"
        )

    algorithm = "unknown"
    try:
        signature = msgspec.convert(manifest.get("signature"), Signature)
        algorithm = signature.algorithm
        if signature.algorithm == UNSIGNED:
            if not allow_unsigned:
                problems.append(
                    "the report is unsigned (written with --unsigned); pass --allow-unsigned to check it anyway"
                )
        else:
            wrong = check_signature(signature, report_signed_message(manifest), key_file=key_file, env=env)
            if wrong is not None:
                problems.append(wrong)
    except msgspec.ValidationError as exc:
        problems.append(f"{MANIFEST} has no valid signature entry: {exc}")

    try:
        problems += _check_contents(directory, manifest)
    except (KeyError, TypeError, AttributeError) as exc:
        problems.append(f"{MANIFEST} is missing or mangles a field ({exc!r}): it was edited")
    if previous is not None:
        problems += _check_previous(manifest, Path(previous))
    return ReportCheck(ok=not problems, problems=problems, signature=algorithm)


def _check_contents(directory: Path, manifest: Mapping[str, Any]) -> list[str]:
    problems: list[str] = []
    if manifest["format"] != REPORT_FORMAT:
        problems.append(f"unknown report format {manifest['format']!r} (expected {REPORT_FORMAT!r})")
    fmt = manifest["row_format"]
    if fmt not in FORMATS:
        return [*problems, f"unknown row_format {fmt!r}"]
    listed = {f["name"]: f for f in manifest["files"]}
    expected = {*row_files(fmt), HTML}
    for name in sorted(expected - set(listed)):
        problems.append(f"{MANIFEST} does not list {name}")
    for name in sorted(set(listed) - expected):
        problems.append(f"{MANIFEST} lists an unexpected file {name!r}")
    on_disk = {p.name for p in directory.iterdir()} - {MANIFEST}
    for name in sorted(on_disk - set(listed)):
        problems.append(f"{name} is in the bundle but not listed in {MANIFEST}")
    for name, entry in sorted(listed.items()):
        path = directory / name
        if name not in expected:
            continue
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size, digest = path.stat().st_size, file_sha256(path)
        if digest != entry["sha256"] or size != entry["bytes"]:
            problems.append(
                f"{name} does not match its sha256 in {MANIFEST} ({size} bytes, sha256 {digest}): it was edited"
            )
    requests_name, completions_name = row_files(fmt)
    if (directory / requests_name).is_file() and (directory / completions_name).is_file():
        problems += _check_counts(directory, manifest, listed, fmt)
    return problems


def _check_counts(directory: Path, manifest: Mapping[str, Any], listed: Mapping[str, Any], fmt: str) -> list[str]:
    """Recount the row files and compare every count in the manifest; also that the groups sum to the totals."""
    requests_name, completions_name = row_files(fmt)
    try:
        found = _recount(directory / requests_name, directory / completions_name, fmt)
    except (ValueError, KeyError, TypeError) as exc:
        return [f"cannot recount the row files: {exc}"]
    counts = manifest["counts"]
    problems = []
    for name, rows in ((requests_name, found["requests"]), (completions_name, found["completions"])):
        if name in listed and listed[name]["rows"] != rows:
            problems.append(f"{name} has {rows} rows but {MANIFEST} says {listed[name]['rows']}")
    for key, value in found.items():
        if counts[key] != value:
            problems.append(
                f"counts.{key} in {MANIFEST} is {json.dumps(counts[key])} but the files give {json.dumps(value)}"
            )
    for group in ("by_adapter", "by_tenant"):
        for unit in ("requests", "completions"):
            total = sum(g[unit] for g in counts[group])
            if total != counts[unit]:
                problems.append(f"counts.{group} sums to {total} {unit} but counts.{unit} is {counts[unit]}")
    if sum(g["completions"] for g in counts["by_finish_reason"]) != counts["completions"]:
        problems.append("counts.by_finish_reason does not sum to counts.completions")
    if sum(g["requests"] for g in counts["by_status"]) != counts["requests"]:
        problems.append("counts.by_status does not sum to counts.requests")
    return problems


def _recount(requests_path: Path, completions_path: Path, fmt: str) -> dict[str, Any]:
    requests = prompt_tokens = generated = errors = 0
    by_adapter: dict[str | None, list[int]] = defaultdict(lambda: [0, 0])
    by_tenant: dict[str | None, list[int]] = defaultdict(lambda: [0, 0])
    by_status: Counter[str] = Counter()
    for row in read_rows(requests_path, fmt):
        requests += 1
        prompt_tokens += int(row["prompt_token_count"])
        generated += int(row["generated_tokens"])
        errors += row["status"] == FAILED
        by_status[row["status"]] += 1
        by_adapter[row["adapter_fingerprint"] or None][0] += 1
        by_tenant[row["tenant"] or None][0] += 1
    completions = completion_tokens = 0
    by_finish: Counter[str] = Counter()
    for row in read_rows(completions_path, fmt):
        completions += 1
        completion_tokens += int(row["generated_token_count"])
        by_finish[row["finish_reason"]] += 1
        by_adapter[row["adapter_fingerprint"] or None][1] += 1
        by_tenant[row["tenant"] or None][1] += 1
    if completion_tokens != generated:
        raise ValueError(
            f"the requests file counts {generated} generated tokens, the completions file {completion_tokens}"
        )
    return {
        "requests": requests,
        "completions": completions,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "errors": errors,
        "by_adapter": group_counts(by_adapter, "adapter_fingerprint"),
        "by_tenant": group_counts(by_tenant, "tenant"),
        "by_finish_reason": kind_counts(by_finish, "finish_reason", "completions"),
        "by_status": kind_counts(by_status, "status", "requests"),
    }


def _check_previous(manifest: Mapping[str, Any], previous: Path) -> list[str]:
    recorded = (manifest.get("previous") or {}).get("manifest_sha256")
    if recorded is None:
        return [f"the report names no previous report, but {previous} was given as its predecessor"]
    try:
        actual = file_sha256(previous / MANIFEST)
    except OSError as exc:
        return [f"cannot read the previous report's {MANIFEST}: {exc.strerror}"]
    if actual != recorded:
        return [f"the previous report's {MANIFEST} (sha256 {actual}) is not the one this report follows ({recorded})"]
    return []
