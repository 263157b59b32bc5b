"""add_lora / remove_lora / pin_lora / list_loras, and prompt logprobs, through the public engines."""

from __future__ import annotations

import pytest
import torch

from loraledger import LLM, AsyncEngine, EngineArgs, LoRARequest, SamplingParams
from loraledger import errors as E
from tests.api.conftest import loras_for, random_prompts
from tests.model_fixtures import hf_reference_logits


def test_add_pin_list_remove(tiny_llama, tmp_path):
    loras = loras_for(tiny_llama)
    prompt = {"prompt_token_ids": random_prompts(1, seed=40)[0]}
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(
        model=str(tiny_llama.model_dir),
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=2,
        max_lora_rank=16,
        audit_url=None,
    ) as llm:
        assert llm.list_loras() == set()
        assert llm.add_lora(loras["qv_r4"]) is True
        with pytest.raises(E.AdapterNotFoundError):
            llm.add_lora(LoRARequest("nowhere", 50, str(tmp_path / "nowhere")))
        assert llm.list_loras() == {loras["qv_r4"].lora_int_id}
        assert llm.pin_lora(loras["qv_r4"].lora_int_id) is True
        with pytest.raises(E.UnknownRequestError):
            llm.pin_lora(99)
        expected = llm.generate(prompt, greedy, lora_request=loras["qv_r4"])[0].outputs[0].token_ids
        # the pinned adapter keeps its slot while the others take turns in the remaining one
        others = llm.generate([prompt, prompt], greedy, lora_request=[loras["all_r8"], loras["ogd_r16_rslora"]])
        assert all(o.finished for o in others)
        assert llm.generate(prompt, greedy, lora_request=loras["qv_r4"])[0].outputs[0].token_ids == expected
        assert llm.remove_lora(loras["qv_r4"].lora_int_id) is True
        assert llm.remove_lora(loras["qv_r4"].lora_int_id) is False
        assert loras["qv_r4"].lora_int_id not in llm.list_loras()
        # once removed, the id may name another folder
        reused = LoRARequest("reused", loras["qv_r4"].lora_int_id, str(tiny_llama.adapters["all_r8"]))
        assert llm.add_lora(reused) is True


async def test_lora_calls_need_enable_lora(tiny_llama):
    async with AsyncEngine.from_engine_args(EngineArgs(model=str(tiny_llama.model_dir), audit_url=None)) as engine:
        assert await engine.list_loras() == set()
        with pytest.raises(E.LoRADisabledError):
            await engine.add_lora(loras_for(tiny_llama)["qv_r4"])


def test_prompt_logprobs_equal_log_softmax_of_reference(llama_llm, tiny_llama):
    loras = loras_for(tiny_llama)
    ids = random_prompts(1, seed=41, lo=12, hi=12)[0]
    out = llama_llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
        lora_request=loras["all_r8"],
    )[0]
    expected = torch.log_softmax(
        hf_reference_logits(tiny_llama.model_dir, tiny_llama.adapters["all_r8"], ids).float(), dim=-1
    )
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[ids[pos]].logprob - expected[pos - 1, ids[pos]].item()) <= 1e-4
        top = torch.topk(expected[pos - 1], 2)
        for alt, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[alt].logprob - lp) <= 1e-4
