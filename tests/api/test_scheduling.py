"""Scheduling under pressure: preemption, adapter slot and host-cache churn, prefix caching per adapter."""

from __future__ import annotations

import pytest

from loraledger import LLM, SamplingParams
from loraledger.errors import PromptError
from tests.api.conftest import loras_for, random_prompts
from tests.model_fixtures import hf_reference_generate


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_tiny_kv_cache_preempts_and_still_matches_reference(tiny_llama):
    loras = loras_for(tiny_llama)
    names = [None, "qv_r4", "all_r8", "ogd_r16_rslora", None, "all_r8"]
    prompts = random_prompts(len(names), seed=20, lo=10, hi=14)
    ref = hf_reference_generate(tiny_llama.model_dir, tiny_llama.adapters, prompts, names, 16, mixed=False)
    # 6 sequences of up to 30 tokens need ~48 blocks of 4; give 20 so some must be preempted and recomputed
    with LLM(
        model=str(tiny_llama.model_dir),
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        block_size=4,
        num_kv_blocks=20,
        audit_url=None,
    ) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            _greedy(16),
            lora_request=[loras[n] if n else None for n in names],
        )
    assert [o.outputs[0].token_ids for o in outs] == ref.token_ids
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the cache was meant to be too small"


def test_more_adapters_than_slots_and_host_cache_of_one(tiny_llama):
    loras = loras_for(tiny_llama)
    names = ["qv_r4", "all_r8", "ogd_r16_rslora", "qv_r4", "all_r8", "ogd_r16_rslora", None]
    prompts = random_prompts(len(names), seed=21)
    ref = hf_reference_generate(tiny_llama.model_dir, tiny_llama.adapters, prompts, names, 6, mixed=False)
    with LLM(
        model=str(tiny_llama.model_dir),
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=1,
        max_lora_rank=16,
        audit_url=None,
    ) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            _greedy(6),
            lora_request=[loras[n] if n else None for n in names],
        )
        assert [o.outputs[0].token_ids for o in outs] == ref.token_ids
        # evicted from the one-adapter host cache, then loaded again on use
        again = llm.generate({"prompt_token_ids": prompts[0]}, _greedy(6), lora_request=loras["qv_r4"])
        assert again[0].outputs[0].token_ids == ref.token_ids[0]
        assert llm.list_loras() == {lora.lora_int_id for lora in loras.values()}


def test_prefix_cache_shared_only_under_the_same_adapter(tiny_llama):
    loras = loras_for(tiny_llama)
    prompt = {"prompt_token_ids": random_prompts(1, seed=22, lo=17, hi=17)[0]}
    with LLM(
        model=str(tiny_llama.model_dir), enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4, audit_url=None
    ) as llm:
        first = llm.generate(prompt, _greedy(3), lora_request=loras["qv_r4"])[0]
        same = llm.generate(prompt, _greedy(3), lora_request=loras["qv_r4"])[0]
        other = llm.generate(prompt, _greedy(3), lora_request=loras["all_r8"])[0]
        base = llm.generate(prompt, _greedy(3))[0]
        base_again = llm.generate(prompt, _greedy(3))[0]
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens == 16  # four full blocks of the 17-token prompt
    assert other.num_cached_tokens == 0, "KV computed under one adapter must never serve another"
    assert base.num_cached_tokens == 0, "nor the base model"
    assert base_again.num_cached_tokens == 16
    assert same.outputs[0].token_ids == first.outputs[0].token_ids


def test_a_request_waiting_for_a_slot_is_not_starved_by_a_busy_adapter(tiny_llama):
    from loraledger import EngineArgs, LLMEngine

    loras = loras_for(tiny_llama)
    busy, waiting = loras["qv_r4"], loras["all_r8"]
    prompts = random_prompts(2, seed=23)
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(tiny_llama.model_dir), enable_lora=True, max_loras=1, max_lora_rank=16, audit_url=None)
    )
    try:
        for i in range(3):
            engine.add_request(f"busy-{i}", {"prompt_token_ids": prompts[0]}, _greedy(6), busy)
        engine.add_request("waiting", {"prompt_token_ids": prompts[1]}, _greedy(6), waiting)
        finished: dict[str, int] = {}
        step = added = 0
        while "waiting" not in finished and step < 400:
            # the busy adapter never runs dry: a new request for it joins every step
            engine.add_request(f"busy-more-{added}", {"prompt_token_ids": prompts[0]}, _greedy(6), busy)
            added += 1
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = step
            step += 1
        assert "waiting" in finished, "the request for the other adapter starved"
        assert sum(1 for rid in finished if rid.startswith("busy")) >= 3
        for rid in [f"busy-more-{i}" for i in range(added)]:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.close()


def test_prefix_cache_shared_only_under_the_same_cache_salt(tiny_llama):
    """vLLM's prompt `cache_salt`: requests with different salts (or one with a salt and one without) never share a
    cached block, requests with the same salt do; greedy output is the same whatever was cached."""
    ids = random_prompts(1, seed=23, lo=17, hi=17)[0]
    loras = loras_for(tiny_llama)
    with LLM(
        model=str(tiny_llama.model_dir), enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4, audit_url=None
    ) as llm:
        salted = llm.generate({"prompt_token_ids": ids, "cache_salt": "tenant-a"}, _greedy(3))[0]
        same = llm.generate({"prompt_token_ids": ids, "cache_salt": "tenant-a"}, _greedy(3))[0]
        other = llm.generate({"prompt_token_ids": ids, "cache_salt": "tenant-b"}, _greedy(3))[0]
        unsalted = llm.generate({"prompt_token_ids": ids}, _greedy(3))[0]
        adapter = llm.generate(
            {"prompt_token_ids": ids, "cache_salt": "tenant-a"}, _greedy(3), lora_request=loras["qv_r4"]
        )[0]
        with pytest.raises(PromptError, match="cache_salt"):
            llm.generate({"prompt_token_ids": ids, "cache_salt": 7}, _greedy(3))
    assert salted.num_cached_tokens == 0
    assert same.num_cached_tokens == 16
    assert other.num_cached_tokens == 0, "KV cached under one salt must never serve another"
    assert unsalted.num_cached_tokens == 0, "nor a request without a salt"
    assert adapter.num_cached_tokens == 0, "nor another adapter under the same salt"
    assert salted.outputs[0].token_ids == same.outputs[0].token_ids == other.outputs[0].token_ids
    assert unsalted.outputs[0].token_ids == salted.outputs[0].token_ids
