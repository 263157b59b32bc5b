"""Greedy outputs and logprobs equal HF transformers + PEFT, for the base model, each adapter alone, and mixed batches."""

from __future__ import annotations

import pytest
import torch

from loraledger import LLM, AsyncEngine, EngineArgs, SamplingParams
from tests.api.conftest import loras_for, random_prompts
from tests.gpu.markers import ON_GPU
from tests.model_fixtures import hf_reference_generate

MAX_NEW = 8


def _greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


# the same check on a GPU (fp32, decode steps replayed from CUDA graphs); see tests/gpu/test_cuda_engine.py
DEVICES = ["cpu", pytest.param("cuda", marks=ON_GPU)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
def test_llm_mixed_batch_equals_hf_peft(arch, device, request):
    if arch == "gemma2" and device == "cuda":
        pytest.skip("soft-capped attention runs on the CPU only (tests/gpu/test_model_families.py: refused on CUDA)")
    tiny = request.getfixturevalue(f"tiny_{arch}")
    loras = loras_for(tiny)
    names = [None, *sorted(loras)] * 2
    prompts = random_prompts(len(names), seed=1)
    ref = hf_reference_generate(tiny.model_dir, tiny.adapters, prompts, names, MAX_NEW, mixed=True)
    with LLM(
        model=str(tiny.model_dir),
        device=device,
        dtype="float32",
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        block_size=4,
        audit_url=None,
    ) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], _greedy(), lora_request=[loras[n] if n else None for n in names]
        )
        assert [o.outputs[0].token_ids for o in outs] == ref.token_ids
        for o, n in zip(outs, names):
            assert o.finished and o.outputs[0].finish_reason == "length"
            assert (o.lora_request.lora_name if o.lora_request else None) == n
            assert (o.outputs[0].lora_request.lora_name if o.outputs[0].lora_request else None) == n
        # each adapter alone, and the base alone, in batches of their own
        for name in [None, *sorted(loras)]:
            ps = prompts[:3]
            solo_ref = hf_reference_generate(tiny.model_dir, tiny.adapters, ps, [name] * 3, MAX_NEW, mixed=False)
            solo = llm.generate(
                [{"prompt_token_ids": p} for p in ps], _greedy(), lora_request=loras[name] if name else None
            )
            assert [o.outputs[0].token_ids for o in solo] == solo_ref.token_ids, name


def test_adapters_change_outputs(llama_llm, tiny_llama):
    loras = loras_for(tiny_llama)
    prompt = {"prompt_token_ids": random_prompts(1, seed=5)[0]}
    texts = {
        name: llama_llm.generate(prompt, _greedy(), lora_request=lora)[0].outputs[0].token_ids
        for name, lora in [("base", None), *loras.items()]
    }
    assert len({tuple(t) for t in texts.values()}) == len(texts), "every adapter must visibly change the greedy output"


async def test_async_engine_mixed_equals_hf(tiny_llama):
    loras = loras_for(tiny_llama)
    names = [*sorted(loras), None]
    prompts = random_prompts(len(names), seed=2)
    ref = hf_reference_generate(tiny_llama.model_dir, tiny_llama.adapters, prompts, names, MAX_NEW, mixed=True)
    args = EngineArgs(
        model=str(tiny_llama.model_dir), enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4, audit_url=None
    )
    results: dict[int, list[int]] = {}
    async with AsyncEngine.from_engine_args(args) as engine:
        import anyio

        async def one(i: int) -> None:
            async for out in engine.generate(
                {"prompt_token_ids": prompts[i]}, _greedy(), f"req-{i}", loras[names[i]] if names[i] else None
            ):
                assert out.lora_request == (loras[names[i]] if names[i] else None)
                if out.finished:
                    results[i] = out.outputs[0].token_ids

        async with anyio.create_task_group() as tg:
            for i in range(len(names)):
                tg.start_soon(one, i)
    assert [results[i] for i in range(len(names))] == ref.token_ids


def test_logprobs_are_vllm_logprob_objects_equal_to_log_softmax_of_reference_logits(llama_llm, tiny_llama):
    """vLLM's rule: each position maps token id -> Logprob(logprob, rank, decoded_token); the sampled token with its
    rank in the vocabulary, then the top k ranked 1..k; decoded_token is tokenizer.decode([id])."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama.model_dir)
    loras = loras_for(tiny_llama)
    names = [None, "all_r8"]
    prompts = random_prompts(2, seed=3)
    ref = hf_reference_generate(tiny_llama.model_dir, tiny_llama.adapters, prompts, names, MAX_NEW, mixed=False)
    outs = llama_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], _greedy(logprobs=3), lora_request=[None, loras["all_r8"]]
    )
    for out, logits, ids in zip(outs, ref.logits, ref.token_ids):
        completion = out.outputs[0]
        assert completion.token_ids == ids
        expected = torch.log_softmax(logits.float(), dim=-1)
        assert len(completion.logprobs) == MAX_NEW
        for pos, (token, entry) in enumerate(zip(ids, completion.logprobs)):
            assert abs(entry[token].logprob - expected[pos, token].item()) <= 1e-4
            assert entry[token].rank == 1  # greedy: the most likely token
            top = torch.topk(expected[pos], 3)
            for rank, (alt, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
                assert abs(entry[alt].logprob - lp) <= 1e-4 and entry[alt].rank == rank
                assert entry[alt].decoded_token == tok.decode([alt])
        assert completion.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(ids, completion.logprobs)), abs=1e-4
        )


def test_text_prompts_tokenized_like_autotokenizer(llama_llm, tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama.model_dir)
    text = "The quick brown fox jumps over the lazy dog"
    out = llama_llm.generate(text, _greedy(4))[0]
    assert out.prompt == text
    assert out.prompt_token_ids == tok(text)["input_ids"]
    by_ids = llama_llm.generate({"prompt_token_ids": tok(text)["input_ids"]}, _greedy(4))[0]
    assert by_ids.outputs[0].token_ids == out.outputs[0].token_ids


def test_base_rows_run_without_adapter_when_every_slot_is_full(tiny_llama):
    """max_loras slots, each holding an adapter, and base-model rows between them in one batch: the base rows'
    greedy ids are the base model's (transformers without PEFT), not any slot's adapter's. vLLM's CPU build
    gets this wrong: its base rows take the last slot's adapter when every slot is full."""
    loras = loras_for(tiny_llama)
    names = [*sorted(loras), None] * 3  # as many adapters as slots, base rows in between
    prompts = random_prompts(len(names), seed=11)
    base_rows = [i for i, n in enumerate(names) if n is None]
    ref_base = hf_reference_generate(
        tiny_llama.model_dir, tiny_llama.adapters, [prompts[i] for i in base_rows], [None] * 3, MAX_NEW, mixed=False
    )
    last = sorted(loras)[-1]
    ref_last = hf_reference_generate(
        tiny_llama.model_dir, tiny_llama.adapters, [prompts[i] for i in base_rows], [last] * 3, MAX_NEW, mixed=False
    )
    assert ref_base.token_ids != ref_last.token_ids, "the last adapter must change these prompts' outputs"
    with LLM(
        model=str(tiny_llama.model_dir),
        dtype="float32",
        enable_lora=True,
        max_loras=len(loras),
        max_lora_rank=16,
        block_size=4,
        audit_url=None,
    ) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], _greedy(), lora_request=[loras[n] if n else None for n in names]
        )
    assert [outs[i].outputs[0].token_ids for i in base_rows] == ref_base.token_ids
