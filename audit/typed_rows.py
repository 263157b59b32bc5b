"""Store rows as typed records, and a binding as the `requests` row it must equal.

Times are stored to the microsecond, so what a row must hold is the record with its times rounded the
way the store rounds them (loraledger.digests.stored_time).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from loraledger.digests import stored_time
from loraledger.store.records import CompletionRecord, RequestRecord
from loraledger.store.rows import adapter_record, request_record  # noqa: F401  (re-exported: one reader of each row)


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
        # revision 0013 on (a row read from an older schema, or a join that leaves them out, has none)
        text_commitment=m.get(prefix + "text_commitment"),
        token_ids_commitment=m.get(prefix + "token_ids_commitment"),
        tool_calls=m.get(prefix + "tool_calls"),
        tool_calls_commitment=m.get(prefix + "tool_calls_commitment"),  # revision 0016 on
    )


def binding_builtins(binding: RequestRecord | Mapping[str, Any]) -> dict[str, Any]:
    """A binding as builtins with its time as stored: what a requests row must equal."""
    out = dict(msgspec.to_builtins(binding)) if isinstance(binding, RequestRecord) else dict(binding)
    if isinstance(out.get("received_at"), (int, float)):
        out["received_at"] = stored_time(out["received_at"])
    return out
