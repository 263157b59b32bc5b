"""Conversions between the audit records (store/records.py) and table rows: unix floats <-> UTC datetimes."""

from __future__ import annotations

from typing import Any

from loraledger.digests import json_roundtrip
from loraledger.store.models import utc_from_unix
from loraledger.store.records import AdapterRecord, CompletionRecord, RequestRecord


def adapter_row(r: AdapterRecord) -> dict[str, Any]:
    """An `adapters` row (column -> value) for the record."""
    return {
        "fingerprint": r.fingerprint,
        "name": r.name,
        "int_id": r.int_id,
        "path": r.path,
        "rank": r.rank,
        "alpha": float(r.alpha),
        "target_modules": [str(m) for m in r.target_modules],
        "base_model_fingerprint": r.base_model_fingerprint,
        "use_rslora": r.use_rslora,
        "first_seen": utc_from_unix(r.first_seen),
        "repo_id": r.repo_id,
        "revision": r.revision,
        "commit_sha": r.commit_sha,
    }


def request_row(r: RequestRecord) -> dict[str, Any]:
    """A `requests` row for the record (JSON values in their stored form, see json_roundtrip)."""
    return {
        "request_id": r.request_id,
        "adapter_fingerprint": r.adapter_fingerprint,
        "lora_name": r.lora_name,
        "lora_int_id": r.lora_int_id,
        "lora_path": r.lora_path,
        "tenant": r.tenant,
        "sampling_params": json_roundtrip(r.sampling_params),
        "prompt_text": r.prompt_text,
        "prompt_sha256": r.prompt_sha256,
        "prompt_token_count": r.prompt_token_count,
        "received_at": utc_from_unix(r.received_at),
        "engine_version": r.engine_version,
        "base_model_fingerprint": r.base_model_fingerprint,
        "key_id": r.key_id,
        "caller_request_id": r.caller_request_id,
        "chat_template_sha256": r.chat_template_sha256,
        "constraint_kind": r.constraint_kind,
        "constraint_sha256": r.constraint_sha256,
        "constraint_text": r.constraint_text,
        "adapter_repo_id": r.adapter_repo_id,
        "adapter_revision": r.adapter_revision,
        "adapter_commit_sha": r.adapter_commit_sha,
        "prompt_commitment": r.prompt_commitment,
        "prompt_token_ids_commitment": r.prompt_token_ids_commitment,
        "tools_sha256": r.tools_sha256,
        "tools_text": r.tools_text,
        "tools_commitment": r.tools_commitment,
        "constraint_commitment": r.constraint_commitment,
        "tool_reading": None if r.tool_reading is None else json_roundtrip(r.tool_reading),
    }


def completion_row(r: CompletionRecord) -> dict[str, Any]:
    """A `completions` row for the record (`index` becomes `completion_index`)."""
    return {
        "request_id": r.request_id,
        "completion_index": r.index,
        "text": r.text,
        "token_ids": list(r.token_ids),
        "cumulative_logprob": r.cumulative_logprob,
        "finish_reason": r.finish_reason,
        "stop_reason": r.stop_reason,
        "adapter_fingerprint": r.adapter_fingerprint,
        "prompt_token_count": r.prompt_token_count,
        "generated_token_count": r.generated_token_count,
        "first_token_at": None if r.first_token_at is None else utc_from_unix(r.first_token_at),
        "finished_at": utc_from_unix(r.finished_at),
        "text_commitment": r.text_commitment,
        "token_ids_commitment": r.token_ids_commitment,
        "tool_calls": r.tool_calls,
        "tool_calls_commitment": r.tool_calls_commitment,
    }


def adapter_record(row: Any) -> AdapterRecord:
    """The AdapterRecord an `adapters` row holds (first_seen back to unix seconds, to the microsecond)."""
    return AdapterRecord(
        fingerprint=row.fingerprint,
        name=row.name,
        int_id=row.int_id,
        path=row.path,
        rank=row.rank,
        alpha=row.alpha,
        target_modules=list(row.target_modules),
        base_model_fingerprint=row.base_model_fingerprint,
        use_rslora=bool(row.use_rslora),
        first_seen=row.first_seen.timestamp(),
        repo_id=row.repo_id,
        revision=row.revision,
        commit_sha=row.commit_sha,
    )


def request_record(row: Any) -> RequestRecord:
    """The RequestRecord a `requests` row holds (times back to unix floats, to the microsecond)."""
    return RequestRecord(
        request_id=row.request_id,
        adapter_fingerprint=row.adapter_fingerprint,
        lora_name=row.lora_name,
        lora_int_id=row.lora_int_id,
        lora_path=row.lora_path,
        tenant=row.tenant,
        sampling_params=row.sampling_params,
        prompt_text=row.prompt_text,
        prompt_sha256=row.prompt_sha256,
        prompt_token_count=row.prompt_token_count,
        received_at=row.received_at.timestamp(),
        engine_version=row.engine_version,
        base_model_fingerprint=row.base_model_fingerprint,
        key_id=row.key_id,
        caller_request_id=row.caller_request_id,
        chat_template_sha256=row.chat_template_sha256,
        constraint_kind=row.constraint_kind,
        constraint_sha256=row.constraint_sha256,
        constraint_text=row.constraint_text,
        adapter_repo_id=row.adapter_repo_id,
        adapter_revision=row.adapter_revision,
        adapter_commit_sha=row.adapter_commit_sha,
        prompt_commitment=row.prompt_commitment,
        prompt_token_ids_commitment=row.prompt_token_ids_commitment,
        tools_sha256=row.tools_sha256,
        tools_text=row.tools_text,
        tools_commitment=row.tools_commitment,
        constraint_commitment=row.constraint_commitment,
        tool_reading=row.tool_reading,
    )
