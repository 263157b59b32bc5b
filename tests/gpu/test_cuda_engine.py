"""End to end on a GPU: device="cuda" generates what HF transformers + PEFT generate.

fp32 greedy tokens equal to the reference's (base model, each adapter alone, a mixed batch) is
the CPU reference test run with device="cuda" (tests/api/test_reference_outputs.py, `gpu` marker).
Here: CUDA-graph replay equals the eager forward, and bf16's teacher-forced prompt logprobs (the
true next token and the reference's top two) against log_softmax of the fp32 reference logits.
Skipped, with the reason printed, without a GPU.
"""

from __future__ import annotations

import torch

from loraledger import LLM, SamplingParams
from tests.api.conftest import loras_for, random_prompts
from tests.gpu.markers import ON_GPU
from tests.model_fixtures import hf_reference_logits

pytestmark = ON_GPU

BF16_LOGPROB_TOL = 2e-2


def _engine(tiny, dtype: str) -> LLM:
    return LLM(
        model=str(tiny.model_dir),
        device="cuda",
        dtype=dtype,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        block_size=4,
        audit_url=None,
        seed=0,
    )


def _hf_bf16_logprobs(model_dir, adapter, ids) -> torch.Tensor:
    """log_softmax of transformers' (+ PEFT's) own forward in bf16 on the GPU: how far plain bf16 lands."""
    from tests.model_fixtures import _adapter_key, _hf_model

    model = _hf_model(str(model_dir), _adapter_key({"ref": adapter} if adapter else {})).to("cuda", torch.bfloat16)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(ids)], device="cuda")).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def test_bf16_logprobs_stay_close_to_fp32_reference(tiny_llama):
    """Teacher-forced bf16 logprobs against the fp32 reference: within 2e-2, or at least as close as
    transformers' own bf16 forward of the same weights gets (the bound this fixture allows; see
    bench/RESULTS.md for both figures)."""
    loras = loras_for(tiny_llama)
    ids = random_prompts(1, seed=43, lo=24, hi=24)[0]
    worst = worst_hf = 0.0
    with _engine(tiny_llama, "bfloat16") as llm:
        for name in [None, *sorted(loras)]:
            out = llm.generate(
                {"prompt_token_ids": ids},
                SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                lora_request=loras[name] if name else None,
            )[0]
            adapter = tiny_llama.adapters[name] if name else None
            expected = torch.log_softmax(hf_reference_logits(tiny_llama.model_dir, adapter, ids), dim=-1)
            hf_bf16 = _hf_bf16_logprobs(tiny_llama.model_dir, adapter, ids)
            for pos in range(1, len(ids)):
                entry = out.prompt_logprobs[pos]
                assert ids[pos] in entry
                top = torch.topk(expected[pos - 1], 2).indices.tolist()
                for token in {ids[pos], *top}:
                    if token in entry:  # bf16 may rank another token second; the true token is always there
                        worst = max(worst, abs(entry[token].logprob - expected[pos - 1, token].item()))
                    worst_hf = max(worst_hf, abs(hf_bf16[pos - 1, token] - expected[pos - 1, token]).item())
    print(f"bf16 logprob error vs the fp32 reference: loraledger {worst:.3e}, transformers bf16 {worst_hf:.3e}")
    assert worst <= max(BF16_LOGPROB_TOL, worst_hf), (
        f"bf16 logprobs off the fp32 reference by {worst:.3e}: above {BF16_LOGPROB_TOL:.0e} and above "
        f"transformers' own bf16 error ({worst_hf:.3e})"
    )


def _cuda_runner(tiny, graph_batch: int):
    from loraledger.gpu.model_runner import ModelRunner
    from loraledger.gpu.ops_cuda import CudaOps

    return ModelRunner(
        tiny.model_dir,
        dtype=torch.float32,
        device=torch.device("cuda", 0),
        ops=CudaOps("cuda"),
        num_kv_blocks=256,
        block_size=4,
        max_loras=4,
        max_lora_rank=16,
        enable_lora=True,
        max_num_batched_tokens=256,
        cuda_graph_max_batch=graph_batch,
    )


def test_cuda_graph_decode_equals_eager(tiny_llama):
    """Decode steps replayed from CUDA graphs (padded batch sizes, LoRA and base-only graphs) give the
    eager forward's tokens and logprobs; the graphs were in fact used."""
    from loraledger.scheduling.step_plan import SamplingSpec
    from tests.gpu.test_model_runner import Driver, _loads

    names = sorted(tiny_llama.adapters)
    prompts = random_prompts(5, seed=17)
    slots = [-1, 0, 1, 2, 0]
    specs = [SamplingSpec(logprobs=0)] * 5
    results = {}
    for graph_batch in (0, 8):
        runner = _cuda_runner(tiny_llama, graph_batch)
        driver = Driver(runner)
        extra = {"slot_loads": _loads(tiny_llama, names)}
        mixed = driver.generate(prompts, slots, specs, 12, first_plan_extra=extra, seq_ids=list(range(5)))
        base = driver.generate(prompts[:1], [-1], specs[:1], 6, seq_ids=[7])
        results[graph_batch] = (mixed, base)
        if graph_batch:
            assert runner.graphs.captured == [(1, False), (8, True)]
        runner.close()
    (eager_mixed, eager_base), (graph_mixed, graph_base) = results[0], results[8]
    assert graph_mixed[0] == eager_mixed[0] and graph_base[0] == eager_base[0]
    for got, want in ((graph_mixed[1], eager_mixed[1]), (graph_base[1], eager_base[1])):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-4)
