"""A resumed request on a Hub adapter runs on the commit its binding names, though the branch moved since (read from
the cache or fetched again, against tests/fake_hub.py), and is refused, on record, only when that commit cannot be had."""

from __future__ import annotations

import hashlib
import time

import anyio
import msgspec
from sqlalchemy import select
from transformers import AutoTokenizer

from loraledger import AsyncEngine, EngineArgs, LoRARequest, RequestOutput, SamplingParams
from loraledger.audit import AuditLog
from loraledger.audit_ids import new_audit_id
from loraledger.digests import digest
from loraledger.lora.checkpoint_reader import fingerprint_adapter, load_lora_checkpoint
from loraledger.sources import HubNotFoundError
from loraledger.store import process_identity
from loraledger.store.audit_store import ADAPTERS, EVENTS, AuditStore
from loraledger.store.instances import this_instance
from loraledger.store.records import AdapterRecord, AuditBatch, EventKind, EventRecord, RequestRecord


def _peer_admits(url: str, tokenizer, *, adapter: AdapterRecord, commit: str, lease: float) -> str:
    """A peer on another machine admits one request on the Hub adapter org/qv read at `commit`, and dies."""
    params = msgspec.to_builtins(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    prompt = "the quick brown fox"
    ids = tokenizer.encode(prompt)
    key = new_audit_id()
    binding = RequestRecord(
        request_id=key, adapter_fingerprint=adapter.fingerprint, lora_name="qv", lora_int_id=1, lora_path="org/qv",
        tenant="acme", sampling_params=params, prompt_text=prompt, prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(),
        prompt_token_count=len(ids), received_at=time.time(), engine_version="0.1.0", base_model_fingerprint="f" * 64,
        caller_request_id=f"job-{commit[:6]}", adapter_repo_id="org/qv", adapter_revision="main", adapter_commit_sha=commit,
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
            peer.write(AuditBatch(adapters=[adapter], requests=[binding], events=[admitted]))
    finally:
        process_identity.process_key = saved
    return key


async def test_a_resumed_request_runs_on_its_bound_commit_though_main_moved(fake_hub, tiny_llama, tmp_path):
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama.model_dir))
    old_fp = fingerprint_adapter(str(tiny_llama.adapters["qv_r4"]))
    old = fake_hub.push("org/qv", tiny_llama.adapters["qv_r4"])
    new = fake_hub.push("org/qv", tiny_llama.adapters["all_r8"])  # main has moved on since the peer admitted
    ckpt = load_lora_checkpoint(
        str(tiny_llama.adapters["qv_r4"]),
        lora_name="qv",
        lora_int_id=1,
        model_config=tiny_llama.config,
        max_lora_rank=16,
    )
    record = msgspec.structs.replace(
        ckpt.to_record("f" * 64, time.time()), path="org/qv", repo_id="org/qv", revision="main", commit_sha=old
    )
    kept = _peer_admits(url, tokenizer, adapter=record, commit=old, lease=3.0)
    gone = _peer_admits(url, tokenizer, adapter=record, commit="0" * 40, lease=3.0)  # a commit the Hub lacks
    args = EngineArgs(
        model=str(tiny_llama.model_dir), block_size=4, audit_url=url, resume_interrupted=True, enable_lora=True,
        max_loras=2, max_lora_rank=16, audit_timeout=1.0, audit_lease_seconds=1.5,
    )  # fmt: skip
    async with AsyncEngine(args) as engine:
        assert engine.interrupted == []  # the peer is alive at this engine's start
        # this engine's own "qv" reads main as it is now
        await engine.add_lora(LoRARequest("qv", 1, "org/qv"))
        with anyio.fail_after(60):
            while kept not in engine.interrupted:  # the peer's lease runs out: this engine recovers its requests
                await anyio.sleep(0.2)
            resumed = await engine.wait_resumed()
    out = resumed[kept]
    assert isinstance(out, RequestOutput) and out.finished, out
    assert isinstance(resumed[gone], HubNotFoundError) and "0" * 40 in str(resumed[gone])
    with AuditLog(url) as log:
        assert log.request(kept).completions[0].adapter_fingerprint == old_fp
        result = log.verify()
        assert result.ok, result.first_problem
    with AuditStore(url) as store, store.engine.connect() as conn:
        events = conn.execute(select(EVENTS).where(EVENTS.c.request_id.in_([kept, gone]))).all()
        adapters = {r.commit_sha: r.fingerprint for r in conn.execute(select(ADAPTERS)).all()}
    kinds = {(e.request_id, e.kind) for e in events}
    assert (kept, EventKind.REQUEST_RESUMED) in kinds and (kept, EventKind.REQUEST_FINISHED) in kinds
    (refused,) = [e.payload for e in events if e.kind == EventKind.RESUME_REFUSED]
    assert refused["bound_commit"] == "0" * 40 and refused["error"].startswith("HubNotFoundError")
    assert (gone, EventKind.REQUEST_RESUMED) not in kinds
    assert adapters == {old: old_fp, new: fingerprint_adapter(str(tiny_llama.adapters["all_r8"]))}
