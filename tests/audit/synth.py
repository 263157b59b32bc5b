"""Synthetic audit logs for the audit tests: several adapters, tenants and days, base-model requests,
n > 1 completions, aborted, failed and unfinished requests, written through AuditStore.write the way
the engine writes them (request_admitted carries the binding, request_finished the completions digest)."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

import msgspec

from loraledger.digests import binding_digest, completions_digest
from loraledger.store.audit_store import AuditStore
from loraledger.store.records import (
    AdapterRecord,
    AuditBatch,
    CompletionRecord,
    EventKind,
    EventRecord,
    RequestRecord,
)

DAY = 86_400.0
START = 1_795_305_600.0  # 2026-11-22T00:00:00Z
BASE_FP = hashlib.sha256(b"tiny-base-model").hexdigest()
TENANTS = ("acme", "globex", "initech", None)
OUTCOMES = ("stop", "stop", "stop", "length", "abort", "failed", "pending")


def _fp(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


ADAPTERS = tuple(
    AdapterRecord(
        fingerprint=_fp(f"adapter-{name}"),
        name=name,
        int_id=i + 1,
        path=f"/adapters/{name}",
        rank=rank,
        alpha=2.0 * rank,
        target_modules=["q_proj", "v_proj"] if rank < 8 else ["q_proj", "k_proj", "v_proj", "o_proj"],
        base_model_fingerprint=BASE_FP,
        use_rslora=rank == 16,
        first_seen=START,
        # read from a Hub repo at a commit (revision 0009 on)
        repo_id=f"org/{name}",
        revision="main",
        commit_sha=hashlib.sha1(name.encode()).hexdigest(),
    )
    for i, (name, rank) in enumerate((("legal-qa", 4), ("support-de", 8), ("sql-gen", 16)))
)


@dataclass
class SynthRequest:
    binding: RequestRecord
    completions: list[CompletionRecord]
    outcome: str  # OUTCOMES value


@dataclass
class SynthLog:
    requests: list[SynthRequest] = field(default_factory=list)
    events: int = 0


def _binding(
    rng: random.Random,
    request_id: str,
    at: float,
    adapter: AdapterRecord | None,
    tenant: str | None,
    key_ids: bool = True,
) -> RequestRecord:
    prompt = f"prompt {request_id} " + "x" * rng.randrange(5, 40)
    return RequestRecord(
        request_id=request_id,
        adapter_fingerprint=adapter.fingerprint if adapter else None,
        lora_name=adapter.name if adapter else None,
        lora_int_id=adapter.int_id if adapter else None,
        lora_path=adapter.path if adapter else None,
        tenant=tenant,
        sampling_params={"n": 1, "temperature": round(rng.random(), 2), "max_tokens": 16, "stop": ["\n\n"]},
        prompt_text=prompt,
        prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(),
        prompt_token_count=rng.randrange(3, 60),
        received_at=at,
        engine_version="0.1.0",
        base_model_fingerprint=BASE_FP,
        # a tenant's requests came through the HTTP server, authenticated by its key (revision 0005 on)
        key_id=f"key-{tenant}" if tenant and key_ids else None,
        # revision 0006 on: the caller's own id, reused once its earlier request finished (as vLLM's LLM.generate
        # numbers requests "0", "1", ... per instance), and the digest of the chat template of chat requests
        caller_request_id=str(int(request_id.rsplit("-", 1)[-1]) % 7) if key_ids else None,
        chat_template_sha256=hashlib.sha256(f"template {tenant}".encode()).hexdigest() if tenant and key_ids else None,
        # and some were constrained to a JSON schema (revision 0008 on)
        **(_constraint(request_id) if tenant and key_ids else {}),
        # the adapter's Hub source for this request (revision 0009 on)
        **(_adapter_source(adapter) if adapter and key_ids else {}),
        # and had tools (revision 0014 on): their completions hold the calls read from their text
        **(_tools(request_id) if tenant and key_ids else {}),
    )


def _adapter_source(adapter: AdapterRecord) -> dict:
    return {
        "adapter_repo_id": adapter.repo_id,
        "adapter_revision": adapter.revision,
        "adapter_commit_sha": adapter.commit_sha,
    }


def _tools(request_id: str) -> dict:
    canonical = '[{"function":{"name":"lookup","parameters":{"type":"object"}},"type":"function"}]'
    return {"tools_sha256": hashlib.sha256(canonical.encode()).hexdigest(), "tools_text": canonical}


def _constraint(request_id: str) -> dict:
    canonical = (
        '{"kind":"json","spec":{"properties":{"id":{"const":"'
        + request_id
        + '"}},"type":"object"},"any_whitespace":true}'
    )
    return {
        "constraint_kind": "json",
        "constraint_sha256": hashlib.sha256(canonical.encode()).hexdigest(),
        "constraint_text": canonical,
    }


def _completions(rng: random.Random, binding: RequestRecord, n: int, reason: str) -> list[CompletionRecord]:
    out = []
    for index in range(n):
        tokens = [rng.randrange(512) for _ in range(rng.randrange(1, 17))]
        first = binding.received_at + rng.random()
        out.append(
            CompletionRecord(
                request_id=binding.request_id,
                index=index,
                text=f'answer {index}, with "quotes", commas\nand a newline ' + " ".join(map(str, tokens[:4])),
                token_ids=tokens,
                cumulative_logprob=-rng.random() * 10 if index % 2 == 0 else None,
                finish_reason=reason,
                stop_reason="\n\n" if reason == "stop" and index == 0 else None,
                adapter_fingerprint=binding.adapter_fingerprint,
                prompt_token_count=binding.prompt_token_count,
                generated_token_count=len(tokens),
                first_token_at=first,
                finished_at=first + rng.random() * 3,
                tool_calls=f'[{{"arguments":{{"n":{index}}},"name":"lookup"}}]' if binding.tools_sha256 else None,
            )
        )
    return out


def build_log(
    store: AuditStore, *, n_requests: int = 60, days: int = 5, seed: int = 0, batch: int = 10, key_ids: bool = True
) -> SynthLog:
    """Write n_requests requests spread over days (UTC) starting at START, in group commits of batch requests.
    key_ids=False: bindings as loraledger wrote them before revision 0005 (no key_id, no access_denied events, and
    none of revision 0006's caller_request_id and chat_template_sha256)."""
    rng = random.Random(seed)
    log = SynthLog()
    pending_events: list[EventRecord] = [
        EventRecord(kind=EventKind.ENGINE_STARTED, at=START, payload={"version": "0.1.0"})
    ]
    pending_events += [
        EventRecord(kind=EventKind.ADAPTER_LOADED, at=START + 1, payload={"fingerprint": a.fingerprint, "name": a.name})
        for a in ADAPTERS
    ]
    # the adapters' rows enter the chain with them: one adapter_registered event each, before these
    log.events = store.write(AuditBatch(adapters=list(ADAPTERS), events=pending_events)).sequence
    times = sorted(START + rng.random() * days * DAY for _ in range(n_requests))
    for start in range(0, n_requests, batch):
        requests: list[RequestRecord] = []
        completions: list[CompletionRecord] = []
        events: list[EventRecord] = []
        for i in range(start, min(n_requests, start + batch)):
            adapter = rng.choice((*ADAPTERS, None))
            binding = _binding(rng, f"req-{seed}-{i:05d}", times[i], adapter, rng.choice(TENANTS), key_ids)
            outcome = rng.choice(OUTCOMES)
            requests.append(binding)
            events.append(
                EventRecord(
                    kind=EventKind.REQUEST_ADMITTED,
                    at=binding.received_at,
                    request_id=binding.request_id,
                    payload={"binding": msgspec.to_builtins(binding), "binding_sha256": binding_digest(binding)},
                    dedup_key=f"admitted:{binding.request_id}",
                )
            )
            mine: list[CompletionRecord] = []
            end = binding.received_at + 5
            if outcome in ("stop", "length"):
                mine = _completions(rng, binding, rng.choice((1, 1, 2, 3)), outcome)
                events.append(
                    EventRecord(
                        kind=EventKind.REQUEST_FINISHED,
                        at=end,
                        request_id=binding.request_id,
                        payload={"completions_sha256": completions_digest(mine), "num_completions": len(mine)},
                        dedup_key=f"end:{binding.request_id}",
                    )
                )
            elif outcome == "abort":
                mine = _completions(rng, binding, 1, "abort")
                events.append(
                    EventRecord(
                        kind=EventKind.REQUEST_ABORTED,
                        at=end,
                        request_id=binding.request_id,
                        payload={"completions_sha256": completions_digest(mine), "num_completions": len(mine)},
                        dedup_key=f"end:{binding.request_id}",
                    )
                )
            elif outcome == "failed":
                events.append(
                    EventRecord(
                        kind=EventKind.REQUEST_FAILED, at=end, request_id=binding.request_id, payload={"error": "boom"}
                    )
                )
            completions += mine
            log.requests.append(SynthRequest(binding=binding, completions=mine, outcome=outcome))
        log.events = store.write(AuditBatch(requests=requests, completions=completions, events=events)).sequence
    if key_ids:  # last (the tests know where earlier events sit): a key asked the server for an adapter it may not use
        denied = EventRecord(
            kind=EventKind.ACCESS_DENIED,
            at=START + days * DAY,
            payload={
                "tenant": "globex",
                "key_id": "key-globex",
                "adapter": ADAPTERS[0].name,
                "route": "/v1/completions",
            },
        )
        log.events = store.write(AuditBatch(events=[denied])).sequence
    return log


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r", "'")  # what a spreadsheet runs as a formula (OWASP), and a quote


def build_formula_log(url: str) -> list[str]:
    """A log of base-model requests whose tenant, prompt, text and stop reason start with each of
    FORMULA_STARTS (one request each, in this order); returns the values."""
    values = [f"{start}SUM(1+1)*cmd|'/C calc'!A0" for start in FORMULA_STARTS]
    requests, completions, events = [], [], []
    for i, value in enumerate(values):
        at = START + i
        binding = RequestRecord(
            request_id=f"formula-{i}", adapter_fingerprint=None, lora_name=None, lora_int_id=None, lora_path=None,
            tenant=value, sampling_params={"n": 1, "max_tokens": 2}, prompt_text=value,
            prompt_sha256=hashlib.sha256(value.encode()).hexdigest(), prompt_token_count=3, received_at=at,
            engine_version="0.1.0", base_model_fingerprint=BASE_FP,
        )  # fmt: skip
        completion = CompletionRecord(
            request_id=binding.request_id, index=0, text=value, token_ids=[1, 2], cumulative_logprob=-2.5,
            finish_reason="stop", stop_reason=value, adapter_fingerprint=None, prompt_token_count=3,
            generated_token_count=2, first_token_at=at + 0.5, finished_at=at + 1,
        )  # fmt: skip
        requests.append(binding)
        completions.append(completion)
        events += [
            EventRecord(kind=EventKind.REQUEST_ADMITTED, at=at, request_id=binding.request_id, dedup_key=f"admit:{i}",
                        payload={"binding": msgspec.to_builtins(binding), "binding_sha256": binding_digest(binding)}),
            EventRecord(kind=EventKind.REQUEST_FINISHED, at=at + 1, request_id=binding.request_id, dedup_key=f"end:{i}",
                        payload={"completions_sha256": completions_digest([completion]), "num_completions": 1}),
        ]  # fmt: skip
    with AuditStore(url) as store:
        store.write(AuditBatch(requests=requests, completions=completions, events=events))
    return values
