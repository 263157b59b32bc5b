"""The audit log after real engine runs: one binding per request, n completions bound to the adapter's fingerprint,
a chain that verifies, prompts kept as asked, duplicate ids refused, and no final output before its commit."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter

import anyio
import pytest
from sqlalchemy import func, select, text

from loraledger import LLM, AsyncEngine, EngineArgs, SamplingParams
from loraledger.digests import text_commitment, token_ids_commitment
from loraledger.lora.checkpoint_reader import fingerprint_adapter
from loraledger.store import texts
from loraledger.store.audit_store import ADAPTERS, COMPLETIONS, EVENTS, REQUESTS, AuditStore
from loraledger.store.records import EventKind
from tests.api.conftest import loras_for

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
WAIT_S = 120  # upper bounds only: a few tiny-model steps, unless a shared 2-core machine is oversubscribed

# the README's auditor query: which adapter, by content, wrote which text
README_JOIN = (
    "SELECT request_id, adapter_name, adapter_fingerprint, text FROM request_lineage "
    "WHERE adapter_fingerprint IS NOT NULL ORDER BY request_id, completion_index"
)


def engine_kwargs(tiny, url: str, **extra) -> dict:
    return dict(
        model=str(tiny.model_dir), enable_lora=True, max_loras=3, max_lora_rank=16, block_size=4, audit_url=url, **extra
    )


def sha256(s: str) -> str:
    return hashlib.sha256(s.encode("utf-8")).hexdigest()


def read_log(url: str) -> dict[str, list]:
    with AuditStore(url) as store:
        with store.engine.connect() as conn:
            return {
                "adapters": conn.execute(select(ADAPTERS)).all(),
                "requests": conn.execute(select(REQUESTS)).all(),
                "completions": conn.execute(
                    select(COMPLETIONS).order_by(COMPLETIONS.c.request_id, COMPLETIONS.c.completion_index)
                ).all(),
                "events": conn.execute(select(EVENTS).order_by(EVENTS.c.seq)).all(),
                "joined": [tuple(row) for row in conn.execute(text(README_JOIN))],
                "texts": conn.execute(select(texts.TEXTS)).all(),
            }


def chain_break(url: str):
    with AuditStore(url) as store:
        return store.first_break()


def test_mixed_adapter_batch_is_on_record_bound_to_each_fingerprint(db_url, tiny_llama):
    loras = loras_for(tiny_llama)
    prompts = ["the base model speaks", "queries and values", "every layer, twice", "rslora on o gate down"]
    per_prompt = [None, loras["qv_r4"], loras["all_r8"], loras["ogd_r16_rslora"]]
    params = [GREEDY, GREEDY, SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=6, ignore_eos=True), GREEDY]
    with LLM(**engine_kwargs(tiny_llama, db_url)) as llm:
        outs = llm.generate(prompts, params, lora_request=per_prompt, tenant="acme")

    fps = {name: fingerprint_adapter(str(path)) for name, path in tiny_llama.adapters.items()}
    log = read_log(db_url)
    requests = {r.request_id: r for r in log["requests"]}
    assert sorted(requests) == sorted(
        o.audit_id for o in outs
    )  # exactly one binding per request, keyed by its audit id
    # vLLM's LLM.generate numbers its requests "0", "1", ...; the binding keeps that id beside its own key
    assert [o.request_id for o in outs] == ["0", "1", "2", "3"]
    assert [requests[o.audit_id].caller_request_id for o in outs] == ["0", "1", "2", "3"]
    base_fps = {r.base_model_fingerprint for r in requests.values()}
    assert len(base_fps) == 1
    for out, lora, prompt, p in zip(outs, per_prompt, prompts, params):
        req = requests[out.audit_id]
        fp = fps[lora.lora_name] if lora else None
        assert req.adapter_fingerprint == fp  # NULL for the base model
        assert (req.lora_name, req.lora_int_id, req.lora_path) == (
            (lora.lora_name, lora.lora_int_id, lora.lora_path) if lora else (None, None, None)
        )
        assert req.tenant == "acme"
        # the prompt is kept apart under a salt (so it can be erased); the binding commits to it
        kept = {(t.request_id, t.part, t.idx): t for t in log["texts"]}
        held = kept[(out.audit_id, "prompt", 0)]
        assert (req.prompt_text, req.prompt_sha256, held.text) == (None, sha256(prompt), prompt)
        assert req.prompt_commitment == text_commitment(held.salt, prompt)
        assert req.prompt_token_ids_commitment == token_ids_commitment(held.salt, out.prompt_token_ids)
        assert req.sampling_params.get("n", 1) == p.n
        rows = [c for c in log["completions"] if c.request_id == out.audit_id]
        assert len(rows) == p.n == len(out.outputs)
        assert [(c.completion_index, c.text, c.token_ids, c.adapter_fingerprint) for c in rows] == [
            (o.index, "", [], fp) for o in out.outputs
        ]
        for c, o in zip(rows, out.outputs):
            held = kept[(out.audit_id, "completion", o.index)]
            assert (held.text, held.token_ids) == (o.text, list(o.token_ids))
            assert c.text_commitment == text_commitment(held.salt, o.text)
            assert c.token_ids_commitment == token_ids_commitment(held.salt, o.token_ids)
    adapters = {a.fingerprint: a for a in log["adapters"]}
    assert set(adapters) == set(fps.values())
    assert {a.name for a in adapters.values()} == set(fps)
    assert {a.base_model_fingerprint for a in adapters.values()} == base_fps

    per_request = Counter((e.kind, e.request_id) for e in log["events"] if e.request_id is not None)
    for out in outs:
        assert per_request[(EventKind.REQUEST_ADMITTED, out.audit_id)] == 1
        assert per_request[(EventKind.REQUEST_FINISHED, out.audit_id)] == 1
    assert chain_break(db_url) is None

    expected = sorted(
        (out.audit_id, lora.lora_name, fps[lora.lora_name], o.text)
        for out, lora in zip(outs, per_prompt)
        if lora is not None
        for o in out.outputs
    )
    assert sorted(log["joined"]) == expected  # the inner join drops the base-model request
    assert len(expected) == 4


@pytest.mark.parametrize("mode", ["hash", "none"])
def test_prompts_are_kept_only_as_audit_prompts_says(db_url, tiny_llama, mode):
    secret = "a confidential prompt"
    with LLM(**engine_kwargs(tiny_llama, db_url, audit_prompts=mode)) as llm:
        outs = llm.generate(
            [secret, {"prompt_token_ids": [11, 12, 13, 14]}],
            GREEDY,
            lora_request=loras_for(tiny_llama)["qv_r4"],
            tenant="t1",
        )
    log = read_log(db_url)
    requests = {r.request_id: r for r in log["requests"]}
    text_req, ids_req = requests[outs[0].audit_id], requests[outs[1].audit_id]
    assert text_req.prompt_text is None and ids_req.prompt_text is None
    if mode == "hash":
        assert text_req.prompt_sha256 == sha256(secret)
        assert len(ids_req.prompt_sha256) == 64 and ids_req.prompt_sha256 != text_req.prompt_sha256
    else:
        assert text_req.prompt_sha256 is None and ids_req.prompt_sha256 is None
    assert ids_req.prompt_token_count == 4
    assert all(r.tenant == "t1" for r in requests.values())
    for event in log["events"]:
        payload = json.dumps(event.payload)
        assert secret not in payload
        # the token ids would give the prompt away as surely as its text
        assert '"prompt_token_ids"' not in payload, (
            f"{event.kind} keeps the prompt's token ids with audit_prompts={mode!r}"
        )
    # nor is the prompt in `request_texts`: only the completions are
    assert {t.part for t in log["texts"]} == {"completion"}
    assert chain_break(db_url) is None


def test_a_caller_id_may_repeat_across_engines_on_one_log_each_request_under_its_own_audit_key(db_url, tiny_llama):
    """vLLM: a request id may be reused once its request has finished, in a later engine too (LLM.generate numbers
    from "0" in every instance); the audit log keys every request with an id of its own and keeps the caller's."""
    qv = loras_for(tiny_llama)["qv_r4"]
    with LLM(**engine_kwargs(tiny_llama, db_url)) as llm:
        first = llm.generate(["one", "two", "three"], GREEDY)
        engine = llm.llm_engine
        engine.add_request("order-42", "the original", GREEDY, tenant="acme")
        while engine.has_unfinished_requests():
            engine.step()
    before = read_log(db_url)

    with LLM(**engine_kwargs(tiny_llama, db_url)) as llm:
        engine = llm.llm_engine
        engine.add_request("order-42", "a different prompt", GREEDY, qv, tenant="mallory")
        second = llm.generate(["one", "two", "three"], GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
    after = read_log(db_url)

    assert [o.request_id for o in first] == [o.request_id for o in second] == ["0", "1", "2"]
    keys = [o.audit_id for o in first + second]
    assert len(set(keys)) == 6, "audit keys never repeat across engines on one log"
    by_caller = Counter(r.caller_request_id for r in after["requests"])
    assert by_caller == {"0": 2, "1": 2, "2": 2, "order-42": 2}
    for r in before["requests"]:  # the earlier bindings are untouched
        assert next(a for a in after["requests"] if a.request_id == r.request_id) == r
    (original,) = [r for r in before["requests"] if r.caller_request_id == "order-42"]
    (repeat,) = [
        r for r in after["requests"] if r.caller_request_id == "order-42" and r.request_id != original.request_id
    ]
    assert (original.tenant, repeat.tenant, repeat.lora_name) == ("acme", "mallory", "qv_r4")
    kinds = [e.kind for e in after["events"] if e.request_id == repeat.request_id]
    assert kinds == [EventKind.REQUEST_ADMITTED, EventKind.REQUEST_FINISHED]
    assert chain_break(db_url) is None


def gate_completion_writes(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Make every store write that carries completions wait for `release`; `reached` is set when one does."""
    reached, release = threading.Event(), threading.Event()
    original = AuditStore.write

    def write(store, batch, **kwargs):
        if batch.completions:
            reached.set()
            release.wait(WAIT_S)
        return original(store, batch, **kwargs)

    monkeypatch.setattr(AuditStore, "write", write)
    return reached, release


def count_completions(store: AuditStore) -> int:
    with store.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(COMPLETIONS)).scalar_one()


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "not-durable"])
async def test_the_final_output_waits_for_its_commit(db_url, tiny_llama, monkeypatch, durable):
    reached, release = gate_completion_writes(monkeypatch)
    lora = loras_for(tiny_llama)["all_r8"]
    finals: list[tuple[object, int]] = []
    got_final = anyio.Event()
    try:
        async with AsyncEngine(EngineArgs(**engine_kwargs(tiny_llama, db_url, audit_durable=durable))) as engine:
            with AuditStore(db_url) as reader:

                async def consume() -> None:
                    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
                    async for out in engine.generate("hold me", params, "held-1", lora, tenant="acme"):
                        if out.finished:
                            # read the log at the very moment the caller gets the output
                            finals.append((out, count_completions(reader)))
                            got_final.set()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(consume)
                    assert await anyio.to_thread.run_sync(reached.wait, WAIT_S), (
                        "the completion rows never reached the store"
                    )
                    if durable:
                        # the commit is stuck in front of the database: the caller must not have the final output
                        with anyio.move_on_after(0.5):
                            await got_final.wait()
                        assert finals == []
                        assert count_completions(reader) == 0
                        release.set()
                    with anyio.fail_after(WAIT_S):
                        await got_final.wait()
                    release.set()
    finally:
        release.set()  # never leave the engine's writer thread waiting
    ((out, rows_when_released),) = finals
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5
    # the control: without audit_durable the output does come out before its rows are written
    assert rows_when_released == (1 if durable else 0)
    log = read_log(db_url)
    assert [(c.request_id, c.completion_index) for c in log["completions"]] == [(out.audit_id, 0)]
    assert [(t.request_id, t.token_ids) for t in log["texts"] if t.part == "completion"] == [
        (out.audit_id, out.outputs[0].token_ids)
    ]
    assert chain_break(db_url) is None


async def test_text_with_a_nul_character_is_recorded_with_a_replacement_char(db_url, tiny_llama):
    # a byte-level tokenizer emits U+0000 like any other byte (token 192 of the tiny one), in prompts and in
    # outputs; PostgreSQL text cannot hold it, so every dialect records U+FFFD there (the sha256 is of the
    # prompt as submitted, and token ids stay exact) instead of the store refusing the record
    prompt = "before\x00after"
    async with AsyncEngine(EngineArgs(**engine_kwargs(tiny_llama, db_url))) as engine:
        with anyio.fail_after(WAIT_S):
            outs = [out async for out in engine.generate(prompt, GREEDY, "nul-1", tenant="ac\x00me")]
    assert outs[-1].finished
    log = read_log(db_url)
    (request,) = log["requests"]
    kept = {t.part: t for t in log["texts"]}
    assert (kept["prompt"].text, request.prompt_sha256) == ("before\ufffdafter", sha256(prompt))
    assert request.tenant == "ac\ufffdme"
    completion = kept["completion"]
    assert completion.text == outs[-1].outputs[0].text.replace("\x00", "\ufffd")
    assert list(completion.token_ids) == outs[-1].outputs[0].token_ids
    assert chain_break(db_url) is None
