"""The same quantized checkpoint files the engine serves, loaded by transformers' own quantizers (+ PEFT), greedy ids
compared in one mixed batch of base and adapter rows.

Exact: compressed-tensors symmetric pack-quantized (transformers decompresses it at the first forward to fp32, the
floats the engine dequantizes to in float32) and bitsandbytes nf4 (bitsandbytes' CPU backend dequantizes it to the
same floats; with double quantization too), except on a CPU with AVX512-BF16, where bitsandbytes runs a one-token
4-bit product through its fused bf16 kernel (`gemv_4bit`): there nf4 is held to the tolerance below. Within LOGPROB_TOL, each mismatch a near-tie (a reference margin under LOGIT_TIE): compressed-tensors
asymmetric (transformers loads it only with dequantize=True, which dequantizes in the scales' fp16), GPTQ and AWQ
(gptqmodel's CPU kernels) and bitsandbytes int8 (LLM.int8(): activations quantized to int8 too). The engine always
runs one mixed batch; so does the reference, except for GPTQ and AWQ, whose PEFT LoRA layers take no adapter_names:
there it runs one batch per adapter (and one for the base rows)."""

from __future__ import annotations

import math

import pytest
import torch

from loraledger import LLM, SamplingParams
from tests.api.conftest import loras_for, random_prompts
from tests.model_fixtures import HFReference, hf_reference_generate
from tests.quantization.quantized_checkpoints import write_quantized

MAX_NEW = 8
# the largest difference the reference routes make to a chosen token's fp32 logprob (measured: under 0.03 on the tiny
# model, whose logits span about +-5), with headroom
LOGPROB_TOL = 0.1
# where greedy ids part, the reference's margin between its token and the engine's
LOGIT_TIE = 0.15

# name: (method, packer arguments, the package transformers' loader needs, exact?, dequantize at load)
FORMATS = {
    "compressed-tensors-4bit-g32-sym": ("compressed-tensors", dict(bits=4, group=32, sym=True), "compressed_tensors", True, False),
    "compressed-tensors-8bit-channel-sym": ("compressed-tensors", dict(bits=8, group=None, sym=True), "compressed_tensors", True, False),
    "compressed-tensors-4bit-g32-asym": ("compressed-tensors", dict(bits=4, group=32, sym=False), "compressed_tensors", False, True),
    "bitsandbytes-nf4": ("bitsandbytes", dict(bits=4, group=64, sym=True), "bitsandbytes", True, False),
    "bitsandbytes-nf4-double-quant": ("bitsandbytes", dict(bits=4, group=64, sym=True, desc_act=True), "bitsandbytes", True, False),
    "bitsandbytes-int8": ("bitsandbytes", dict(bits=8, group=None, sym=True), "bitsandbytes", False, False),
    "gptq-4bit-g32-desc-act": ("gptq", dict(bits=4, group=32, sym=False, desc_act=True), "gptqmodel", False, False),
    "awq-4bit-g64": ("awq", dict(bits=4, group=64, sym=False), "gptqmodel", False, False),
}  # fmt: skip


def _bitsandbytes_decodes_in_bf16() -> bool:
    """bitsandbytes' CPU backend registers a fused bf16 `gemv_4bit` (activations and absmax cast to bf16) on a CPU
    with AVX512-BF16, and uses it for every one-token product: decode steps are then bf16, not the fp32 dequantized
    product."""
    from bitsandbytes.functional import has_avx512bf16

    return bool(has_avx512bf16())


def _per_adapter_reference(checkpoint, adapters, prompts, names) -> HFReference:
    token_ids, logits = [None] * len(prompts), [None] * len(prompts)
    for name in set(names):
        rows = [i for i, n in enumerate(names) if n == name]
        part = hf_reference_generate(checkpoint, {name: adapters[name]} if name else {}, [prompts[i] for i in rows],
                                     [name] * len(rows), MAX_NEW)  # fmt: skip
        for row, i in enumerate(rows):
            token_ids[i], logits[i] = part.token_ids[row], part.logits[row]
    return HFReference(token_ids=token_ids, logits=logits)


def _engine(model, tiny_llama, prompts, names):
    loras = loras_for(tiny_llama)
    with LLM(model=str(model), tokenizer=str(tiny_llama.model_dir), device="cpu", dtype="float32", enable_lora=True,
             max_loras=3, max_lora_rank=16, block_size=4, audit_url=None) as llm:  # fmt: skip
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0),
            lora_request=[loras[n] if n else None for n in names],
        )
    ids = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, i)] for o, i in zip(outs, ids)]
    return ids, logprobs


@pytest.mark.parametrize("name", list(FORMATS))
def test_greedy_ids_equal_transformers_own_loader_on_the_same_file(name, tiny_llama, tmp_path):
    method, kwargs, package, exact, dequantize = FORMATS[name]
    pytest.importorskip(package, reason=f"transformers loads {method} checkpoints with {package} (the test extra)")
    if method == "bitsandbytes" and kwargs["bits"] == 4:
        exact = exact and not _bitsandbytes_decodes_in_bf16()
    checkpoint, _ = write_quantized(tiny_llama.model_dir, tmp_path, method, **kwargs)
    names = [None, *sorted(tiny_llama.adapters)] * 2
    prompts = random_prompts(len(names), seed=5)
    if method in ("gptq", "awq"):  # PEFT's GPTQ / AWQ LoRA layers run no mixed batch: one reference batch per adapter
        ref = _per_adapter_reference(checkpoint, tiny_llama.adapters, prompts, names)
    else:
        ref = hf_reference_generate(checkpoint, tiny_llama.adapters, prompts, names, MAX_NEW, dequantize=dequantize)
    ours, logprobs = _engine(checkpoint, tiny_llama, prompts, names)
    if exact:
        assert ours == ref.token_ids
        return
    worst = 0.0
    for i, (a, b) in enumerate(zip(ours, ref.token_ids)):
        for step, (x, y) in enumerate(zip(a, b)):
            reference = torch.log_softmax(ref.logits[i][step], dim=-1)
            if x != y:
                margin = float(ref.logits[i][step][y] - ref.logits[i][step][x])
                assert margin < LOGIT_TIE, f"row {i} parts at step {step} with a reference margin of {margin:.3f}"
                break
            worst = max(worst, abs(logprobs[i][step] - float(reference[x])))
    assert worst < LOGPROB_TOL, f"a chosen token's logprob differs by {worst:.4f}"
    assert not math.isnan(worst)
