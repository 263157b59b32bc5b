"""Requests written as the engine writes them from revision 0013 on: text in `request_texts`, salted commitments
in the binding and the completions rows (store/texts.py); for tests that need them without running a model."""

from __future__ import annotations

import hashlib

import msgspec

from loraledger.digests import binding_digest, completions_digest
from loraledger.store import records
from loraledger.store.audit_store import AuditStore
from loraledger.store.records import AdapterRecord, AuditBatch, CompletionRecord, EventKind, EventRecord, RequestRecord

BASE_FP = "b" * 64


def salted_batch(
    request_id: str, *, at: float, tenant: str | None, adapter: AdapterRecord | None = None, n: int = 2
) -> AuditBatch:
    """One request admitted and finished with n completions, its prompt and completions as salted text."""
    prompt = f"the prompt of {request_id}, personal data \u00e9"
    prompt_ids = [11, 12, 13]
    kept_prompt = records.salted_text(request_id, records.PROMPT, 0, prompt, prompt_ids)
    committed = records.text_commitments(kept_prompt)
    binding = RequestRecord(
        request_id=request_id, adapter_fingerprint=adapter.fingerprint if adapter else None,
        lora_name=adapter.name if adapter else None, lora_int_id=adapter.int_id if adapter else None,
        lora_path=adapter.path if adapter else None, tenant=tenant, sampling_params={"n": n, "max_tokens": 4},
        prompt_text=None, prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(), prompt_token_count=3,
        received_at=at, engine_version="0.1.0", base_model_fingerprint=adapter.base_model_fingerprint if adapter else BASE_FP,
        caller_request_id=request_id, prompt_commitment=committed[0], prompt_token_ids_commitment=committed[1],
    )  # fmt: skip
    kept = [
        records.salted_text(request_id, records.COMPLETION, i, f"answer {i} to {request_id}", [20 + i, 30 + i])
        for i in range(n)
    ]
    completions = []
    for k in kept:
        text_c, ids_c = records.text_commitments(k)
        completions.append(
            CompletionRecord(
                request_id=request_id, index=k.index, text="", token_ids=[], cumulative_logprob=-1.5,
                finish_reason="stop", stop_reason="\n", adapter_fingerprint=binding.adapter_fingerprint,
                prompt_token_count=3, generated_token_count=2, first_token_at=at + 0.5, finished_at=at + 1.0,
                text_commitment=text_c, token_ids_commitment=ids_c,
            )
        )  # fmt: skip
    events = [
        EventRecord(kind=EventKind.REQUEST_ADMITTED, at=at, request_id=request_id, dedup_key=f"admit:{request_id}",
                    payload={"binding": msgspec.to_builtins(binding), "binding_sha256": binding_digest(binding)}),
        EventRecord(kind=EventKind.REQUEST_FINISHED, at=at + 1.0, request_id=request_id, dedup_key=f"end:{request_id}",
                    payload={"completions_sha256": completions_digest(completions), "num_completions": n,
                             "finish_reason_counts": {"stop": n}, "num_preemptions": 0}),
    ]  # fmt: skip
    return AuditBatch(requests=[binding], completions=completions, events=events, texts=[kept_prompt, *kept])


def write_salted(store: AuditStore, request_ids: list[str], *, at: float, tenant: str | None, **kw) -> None:
    for i, rid in enumerate(request_ids):
        store.write(salted_batch(rid, at=at + i, tenant=tenant, **kw))
