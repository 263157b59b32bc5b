"""Quantized base models served on a GPU (`gpu` marker; skipped with the reason printed without one): device="cuda"
packs the projections in the device layout and runs them on the W4A16 / W8A16 kernels, base and adapters in one
mixed batch, CUDA graphs on.

float32: the kernels compute with the checkpoint's exact weights in fp32, as the CPU fp32 engine (which dequantizes
them at load) and transformers + PEFT on the dequantized weights do: greedy ids must be equal to both. bfloat16:
greedy ids may part from the fp32 reference only at a near-tie (test_quantized_engine.LOGIT_TIE). A CUDA-graph decode
of a quantized base gives the eager forward's tokens and logprobs.
"""

from __future__ import annotations

import pytest
import torch

from loraledger import LLM, LoRARequest, SamplingParams
from tests.api.conftest import loras_for, random_prompts
from tests.gpu.markers import ON_GPU
from tests.model_fixtures import hf_reference_generate
from tests.quantization.quantized_checkpoints import (
    GGUF_KINDS,
    QUANTIZED_FORMATS,
    build_wide_llama,
    write_gguf,
    write_quantized,
)
from tests.quantization.test_quantized_engine import _check_near_ties, transformers_gguf_copy

pytestmark = ON_GPU

MAX_NEW = 10
SERVED = ("ct-w4-g32-asym", "ct-w4-g64-sym", "ct-w8-channel", "gptq-g_idx", "gptq-w8a16-g64", "awq", "bnb-int8", "nf4")  # fmt: skip
FORMATS = {name: QUANTIZED_FORMATS[name] for name in SERVED}  # nf4: dequantized at load, on record


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized-cuda-engine")
    out = {name: write_quantized(tiny_llama.model_dir, root, m, **kw) for name, (m, kw) in FORMATS.items()}
    for kind in GGUF_KINDS:
        path = write_gguf(tiny_llama.model_dir, root / f"tiny.{kind}.gguf", kind)
        out[kind] = (path, transformers_gguf_copy(path, tiny_llama.model_dir, root / f"tiny-{kind}-transformers"))
    return out


def _generate(model, tokenizer, device, dtype, prompts, names, loras, **kw):
    with LLM(model=str(model), tokenizer=str(tokenizer), device=device, dtype=dtype, enable_lora=True, max_loras=3,
             max_lora_rank=16, block_size=4, audit_url=None, **kw) as llm:  # fmt: skip
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
            lora_request=[loras[n] if n else None for n in names],
        )
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name", [*FORMATS, *GGUF_KINDS])
def test_greedy_ids_on_cuda_equal_the_cpu_fp32_engine_and_transformers_peft(name, checkpoints, tiny_llama):
    model, reference = checkpoints[name]
    loras = loras_for(tiny_llama)
    names = [None, *sorted(loras)] * 2
    prompts = random_prompts(len(names), seed=3)
    ref = hf_reference_generate(reference, tiny_llama.adapters, prompts, names, MAX_NEW)
    tok = tiny_llama.model_dir
    cuda = _generate(model, tok, "cuda", "float32", prompts, names, loras)
    assert cuda == ref.token_ids
    assert cuda == _generate(model, tok, "cpu", "float32", prompts, names, loras)
    _check_near_ties(_generate(model, tok, "cuda", "bfloat16", prompts, names, loras), ref)


def test_q4_k_on_cuda_equals_transformers_peft(tmp_path):
    """Q4_K's fp32 per-32 scales and mins in the device layout (a model whose rows are whole super-blocks)."""
    model_dir, adapters = build_wide_llama(tmp_path)
    path = write_gguf(model_dir, tmp_path / "wide.Q4_K.gguf", "Q4_K")
    reference = transformers_gguf_copy(path, model_dir, tmp_path / "wide-Q4_K-transformers")
    loras = {name: LoRARequest(name, i + 1, str(p)) for i, (name, p) in enumerate(sorted(adapters.items()))}
    names = [None, "all_r8", "qv_r4"] * 2
    prompts = random_prompts(len(names), seed=8)
    ref = hf_reference_generate(reference, adapters, prompts, names, MAX_NEW)
    assert _generate(path, model_dir, "cuda", "float32", prompts, names, loras) == ref.token_ids
    _check_near_ties(_generate(path, model_dir, "cuda", "bfloat16", prompts, names, loras), ref)


def test_cuda_graph_decode_of_a_quantized_base_equals_eager(checkpoints, tiny_llama):
    """The quantized decode (the GEMV kernels, the LoRA kernels on their outputs) captured in CUDA graphs gives the
    eager forward's tokens and logprobs, and the graphs were in fact used."""
    from loraledger.gpu import base_model
    from loraledger.gpu.model_runner import ModelRunner
    from loraledger.gpu.ops_cuda import CudaOps
    from loraledger.gpu.quant_projection import DeviceQuantProjection
    from loraledger.scheduling.step_plan import SamplingSpec
    from tests.gpu.test_model_runner import Driver, _loads

    model = checkpoints["gptq-g_idx"][0]
    prompts = random_prompts(5, seed=17)
    slots, specs = [-1, 0, 1, 2, 0], [SamplingSpec(logprobs=0)] * 5
    results = {}
    for graph_batch in (0, 8):
        runner = ModelRunner(
            model, dtype=torch.bfloat16, device=torch.device("cuda", 0), ops=CudaOps("cuda"), num_kv_blocks=256,
            block_size=4, max_loras=4, max_lora_rank=16, enable_lora=True, max_num_batched_tokens=256,
            cuda_graph_max_batch=graph_batch, quantization=base_model.read_quantization(model),
        )  # fmt: skip
        assert isinstance(runner.model.layers[0].gate_up, DeviceQuantProjection)
        driver = Driver(runner)
        extra = {"slot_loads": _loads(tiny_llama, sorted(tiny_llama.adapters))}
        results[graph_batch] = driver.generate(
            prompts, slots, specs, 12, first_plan_extra=extra, seq_ids=list(range(5))
        )
        if graph_batch:
            assert (8, True) in runner.graphs.captured
        runner.close()
    assert results[8][0] == results[0][0]
    torch.testing.assert_close(torch.tensor(results[8][1]), torch.tensor(results[0][1]), rtol=0, atol=1e-4)
