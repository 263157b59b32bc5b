"""Requests written as the engine writes them from revision 0013 on: text in `request_texts`, salted commitments
in the binding and the completions rows (store/texts.py), with tools, a constraint and tool calls kept apart as from
revision 0016 on; for tests that need them without running a model."""

from __future__ import annotations

import hashlib

import msgspec

from loraledger.digests import binding_digest, canonical_json, completions_digest
from loraledger.store import texts
from loraledger.store.audit_store import AuditStore
from loraledger.store.records import (
    AdapterRecord,
    AuditBatch,
    CompletionRecord,
    EventKind,
    EventRecord,
    RequestRecord,
    salted_content,
    salted_text,
    text_commitments,
)

BASE_FP = "b" * 64
MARKER = "zq-erasable-marker"  # in every text these requests keep apart: after erasure, no table may hold it


def salted_batch(
    request_id: str, *, at: float, tenant: str | None, adapter: AdapterRecord | None = None, n: int = 2
) -> AuditBatch:
    """One request admitted and finished with n completions, its prompt and completions as salted text."""
    prompt = f"the prompt of {request_id}, personal data \u00e9"
    prompt_ids = [11, 12, 13]
    kept_prompt = salted_text(request_id, texts.PROMPT, 0, prompt, prompt_ids)
    committed = text_commitments(kept_prompt)
    # its tools, constraint and tool calls as the engine keeps them from revision 0016 on: apart, under salts
    tools = canonical_json([{"type": "function", "function": {"name": "lookup", "description": f"{MARKER} tools"}}])
    kept_tools, tools_c = salted_content(request_id, texts.TOOLS, 0, tools.decode())
    constraint = canonical_json({"json": {"type": "object", "description": f"{MARKER} schema"}}).decode()
    kept_constraint, constraint_c = salted_content(request_id, texts.CONSTRAINT, 0, constraint)
    binding = RequestRecord(
        request_id=request_id, adapter_fingerprint=adapter.fingerprint if adapter else None,
        lora_name=adapter.name if adapter else None, lora_int_id=adapter.int_id if adapter else None,
        lora_path=adapter.path if adapter else None, tenant=tenant, sampling_params={"n": n, "max_tokens": 4},
        prompt_text=None, prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(), prompt_token_count=3,
        received_at=at, engine_version="0.1.0", base_model_fingerprint=adapter.base_model_fingerprint if adapter else BASE_FP,
        caller_request_id=request_id, prompt_commitment=committed[0], prompt_token_ids_commitment=committed[1],
        constraint_kind="json", constraint_sha256=hashlib.sha256(constraint.encode()).hexdigest(),
        constraint_commitment=constraint_c, tools_sha256=hashlib.sha256(tools).hexdigest(), tools_commitment=tools_c,
        tool_reading={"mode": "auto", "parser": "hermes", "parallel": True, "name_index": None},
    )  # fmt: skip
    kept = [
        salted_text(request_id, texts.COMPLETION, i, f"answer {i} to {request_id}", [20 + i, 30 + i]) for i in range(n)
    ]
    completions, calls = [], []
    for k in list(kept):
        text_c, ids_c = text_commitments(k)
        call = canonical_json([{"arguments": {"secret": f"{MARKER} argument {k.index}"}, "name": "lookup"}]).decode()
        kept_call, call_c = salted_content(request_id, texts.TOOL_CALLS, k.index, call)
        calls.append(kept_call)
        completions.append(
            CompletionRecord(
                request_id=request_id, index=k.index, text="", token_ids=[], cumulative_logprob=-1.5,
                finish_reason="stop", stop_reason="\n", adapter_fingerprint=binding.adapter_fingerprint,
                prompt_token_count=3, generated_token_count=2, first_token_at=at + 0.5, finished_at=at + 1.0,
                text_commitment=text_c, token_ids_commitment=ids_c, tool_calls_commitment=call_c,
            )
        )  # fmt: skip
    events = [
        EventRecord(kind=EventKind.REQUEST_ADMITTED, at=at, request_id=request_id, dedup_key=f"admit:{request_id}",
                    payload={"binding": msgspec.to_builtins(binding), "binding_sha256": binding_digest(binding)}),
        EventRecord(kind=EventKind.REQUEST_FINISHED, at=at + 1.0, request_id=request_id, dedup_key=f"end:{request_id}",
                    payload={"completions_sha256": completions_digest(completions), "num_completions": n,
                             "finish_reason_counts": {"stop": n}, "num_preemptions": 0}),
    ]  # fmt: skip
    return AuditBatch(
        requests=[binding],
        completions=completions,
        events=events,
        texts=[kept_prompt, *kept, kept_tools, kept_constraint, *calls],
    )


def write_salted(store: AuditStore, request_ids: list[str], *, at: float, tenant: str | None, **kw) -> None:
    for i, rid in enumerate(request_ids):
        store.write(salted_batch(rid, at=at + i, tenant=tenant, **kw))
