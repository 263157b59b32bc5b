"""Store rows as typed records, and the digests that bind request events to those rows.

Times are stored to the microsecond, so a digest that must be recomputable from the rows is
taken over records whose times are rounded the way the store rounds them (`stored_time`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from loraledger.store.canonical import digest
from loraledger.store.models import utc_from_unix
from loraledger.store.records import CompletionRecord, RequestRecord
from loraledger.store.rows import adapter_record, request_record  # noqa: F401  (re-exported: one reader of each row)

_COMPLETION_TIMES = ("first_token_at", "finished_at")


def stored_time(unix: float | None) -> float | None:
    """unix seconds as they read back from the store (rounded to the microsecond)."""
    return None if unix is None else utc_from_unix(unix).timestamp()


def completion_record(row: Any, prefix: str = "") -> CompletionRecord:
    """A completions row (its columns optionally prefixed, as in a join) as a CompletionRecord."""
    m = row._mapping

    def col(name: str) -> Any:
        return m[prefix + name]

    first_token_at = col("first_token_at")
    return CompletionRecord(
        request_id=col("request_id"),
        index=col("completion_index"),
        text=col("text"),
        token_ids=list(col("token_ids")),
        cumulative_logprob=col("cumulative_logprob"),
        finish_reason=col("finish_reason"),
        stop_reason=col("stop_reason"),
        adapter_fingerprint=col("adapter_fingerprint"),
        prompt_token_count=col("prompt_token_count"),
        generated_token_count=col("generated_token_count"),
        first_token_at=None if first_token_at is None else first_token_at.timestamp(),
        finished_at=col("finished_at").timestamp(),
    )


def binding_builtins(binding: RequestRecord | Mapping[str, Any]) -> dict[str, Any]:
    """A binding as builtins with its time as stored: what a requests row must equal."""
    out = dict(msgspec.to_builtins(binding)) if isinstance(binding, RequestRecord) else dict(binding)
    if isinstance(out.get("received_at"), (int, float)):
        out["received_at"] = stored_time(out["received_at"])
    return out


def completion_builtins(record: CompletionRecord) -> dict[str, Any]:
    out = msgspec.to_builtins(record)
    for name in _COMPLETION_TIMES:
        out[name] = stored_time(out[name])
    return out


def completions_digest(records: Iterable[CompletionRecord]) -> str:
    """The `completions_sha256` of a request_finished event: its completions in index order, times as stored."""
    ordered = sorted(records, key=lambda r: r.index)
    return digest([completion_builtins(r) for r in ordered])


def binding_digest(binding: RequestRecord) -> str:
    """The `binding_sha256` of a request_admitted event: the binding exactly as the payload carries it."""
    return digest(msgspec.to_builtins(binding))
