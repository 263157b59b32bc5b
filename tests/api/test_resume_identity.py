"""A request a dead peer instance admitted, resumed by its replacement: it keeps its audit key, its caller id and its
constraint, the replacement writes what happens next under its own instance id, and the log verifies."""

from __future__ import annotations

import hashlib
import time

import anyio
import msgspec
from sqlalchemy import select
from transformers import AutoTokenizer

from loraledger import AsyncEngine, EngineArgs, RequestOutput, SamplingParams
from loraledger.audit import AuditLog
from loraledger.audit_ids import new_audit_id
from loraledger.digests import digest
from loraledger.lora.checkpoint_reader import load_lora_checkpoint
from loraledger.lora.request import LoRARequest
from loraledger.sampling_params import StructuredOutputsParams
from loraledger.store import process_identity
from loraledger.store.audit_store import EVENTS, AuditStore
from loraledger.store.instances import this_instance
from loraledger.store.records import AdapterRecord, AuditBatch, EventKind, EventRecord, RequestRecord
from loraledger.structured_outputs import canonical_constraint

CHOICES = ["yes", "no", "maybe later"]


def _peer_admits(
    url: str, tokenizer, caller_id: str, *, adapter: AdapterRecord | None = None, lease: float = 1.0
) -> str:
    """A peer instance on another machine admits one constrained request under `caller_id` (on `adapter`, as the
    peer registered it) and dies: its lease runs out `lease` seconds later."""
    so = StructuredOutputsParams(choice=CHOICES)
    constraint = canonical_constraint(so)
    params = msgspec.to_builtins(SamplingParams(temperature=0, max_tokens=8))
    prompt = "the quick brown fox jumps over the lazy dog, then the quick brown fox jumps over it again"
    ids = tokenizer.encode(prompt)
    key = new_audit_id()
    a = adapter
    binding = RequestRecord(
        request_id=key, adapter_fingerprint=a and a.fingerprint, lora_name=a and a.name, lora_int_id=a and a.int_id,
        lora_path=a and a.path, tenant="acme",
        sampling_params=params, prompt_text=prompt, prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(),
        prompt_token_count=len(ids), received_at=time.time(), engine_version="0.1.0", base_model_fingerprint="f" * 64,
        caller_request_id=caller_id, chat_template_sha256="c" * 64,
        constraint_kind=constraint.kind, constraint_sha256=constraint.sha256, constraint_text=constraint.canonical,
    )  # fmt: skip
    built = msgspec.to_builtins(binding)
    payload = {"binding": built, "binding_sha256": digest(built), "prompt_token_ids": ids}
    admitted = EventRecord(
        kind=EventKind.REQUEST_ADMITTED, at=time.time(), request_id=key, payload=payload, dedup_key=f"admit:{key}"
    )
    saved = process_identity.process_key
    process_identity.process_key = lambda: "another-machine/pid:[1]/4242/99"  # only its lease can tell it is gone
    try:
        with AuditStore(url, timeout=5.0) as peer:
            peer.register(this_instance("0.1.0", lease))
            peer.write(AuditBatch(adapters=[adapter] if adapter else [], requests=[binding], events=[admitted]))
    finally:
        process_identity.process_key = saved
    return key


async def test_a_dead_peers_constrained_request_is_resumed_with_its_key_caller_id_and_constraint(tiny_llama, tmp_path):
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama.model_dir))
    key = _peer_admits(url, tokenizer, "job-7")
    time.sleep(1.2)
    args = EngineArgs(model=str(tiny_llama.model_dir), block_size=4, audit_url=url, resume_interrupted=True)
    async with AsyncEngine(args) as engine:
        with anyio.fail_after(120):
            resumed = await engine.wait_resumed()
        # its cache_salt is not on record: the resumed request's KV blocks are its own, never another's prefix
        ids = tokenizer.encode(
            "the quick brown fox jumps over the lazy dog, then the quick brown fox jumps over it again"
        )
        assert len(ids) > 8
        greedy = SamplingParams(temperature=0, max_tokens=1)
        after = [o async for o in engine.generate({"prompt_token_ids": ids}, greedy)][-1]
        again = [o async for o in engine.generate({"prompt_token_ids": ids}, greedy)][-1]
        me = engine.instance_id
    assert after.num_cached_tokens == 0, "a resumed request's cached blocks served another request"
    assert again.num_cached_tokens > 0  # the prompt is long enough to be cached at all
    out = resumed[key]
    assert isinstance(out, RequestOutput) and out.finished, out
    assert (out.request_id, out.audit_id) == ("job-7", key)
    assert out.outputs[0].text in CHOICES  # the constraint on record, applied again
    with AuditLog(url) as log:
        lineage = log.request(key)
        assert lineage.binding.caller_request_id == "job-7" and lineage.binding.chat_template_sha256 == "c" * 64
        assert lineage.status == "finished" and lineage.completions[0].text == out.outputs[0].text
        assert log.resolve_request_ids("job-7") == ([key], 1)
        result = log.verify()
        assert result.ok, result.first_problem
    with AuditStore(url) as store, store.engine.connect() as conn:
        writers = {
            k: i for k, i in conn.execute(select(EVENTS.c.kind, EVENTS.c.instance_id).where(EVENTS.c.request_id == key))
        }
    assert writers[EventKind.REQUEST_RESUMED] == writers[EventKind.REQUEST_FINISHED] == me


async def test_a_resumed_request_runs_on_its_adapter_whatever_id_the_replacement_gave_another(tiny_llama, tmp_path):
    """lora_int_id is a handle of the engine that admitted the request: the replacement (a running peer, or a Ray
    replica that numbers the adapters it serves from 1) may hold that id for another adapter, or hand it out
    later. The resumed request runs on its own adapter, and takes no id the replacement's callers use."""
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama.model_dir))
    names = sorted(tiny_llama.adapters)
    mine, theirs, later = names[0], names[1], names[2]
    ckpt = load_lora_checkpoint(
        str(tiny_llama.adapters[theirs]),
        lora_name=theirs,
        lora_int_id=1,
        model_config=tiny_llama.config,
        max_lora_rank=16,
    )
    # the peer served `theirs` as lora_int_id 1 (its first adapter), and dies 3 s from now
    key = _peer_admits(url, tokenizer, "job-8", adapter=ckpt.to_record("f" * 64, time.time()), lease=3.0)
    args = EngineArgs(
        model=str(tiny_llama.model_dir), block_size=4, audit_url=url, resume_interrupted=True, enable_lora=True,
        max_loras=2, max_lora_rank=16, audit_timeout=1.0, audit_lease_seconds=1.5,
    )  # fmt: skip
    async with AsyncEngine(args) as engine:
        assert engine.interrupted == []  # the peer is alive at this engine's start
        await engine.add_lora(LoRARequest(mine, 1, str(tiny_llama.adapters[mine])))  # this engine's first adapter is 1
        with anyio.fail_after(60):
            while key not in engine.interrupted:  # the peer's lease runs out: this engine recovers it while it runs
                await anyio.sleep(0.2)
            resumed = await engine.wait_resumed()
        # this engine's callers number their adapters on: 2 is free for them
        await engine.add_lora(LoRARequest(later, 2, str(tiny_llama.adapters[later])))
    out = resumed[key]
    assert isinstance(out, RequestOutput) and out.finished, out
    assert out.outputs[0].text in CHOICES and out.lora_request.lora_name == theirs
    with AuditLog(url) as log:
        assert log.request(key).completions[0].adapter_fingerprint == ckpt.fingerprint
        result = log.verify()
        assert result.ok, result.first_problem
