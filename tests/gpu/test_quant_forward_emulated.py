"""A quantized base model's whole forward on the CUDA path (weights packed in the device layout, every projection
through CudaOps.quant_linear, the kernels emulated on the CPU) against the CPU path's fp32 forward on the same
dequantized weights, a prefill step of four sequences (17 rows: the dequantize + matmul path), then a decode step
(4 rows: the GEMV). One format runs them as a mixed batch of the base model and three adapters (the LoRA deltas
land on the quantized projections' outputs); the others run the base model alone, since the emulated LoRA kernels
cost seconds a step and add nothing a format could change.

Tolerance 1e-4 on fp32 logits (they span about +-5): both sides compute with the identical fp32 weights (the
device layout is exact: tests/quantization/test_device_layout.py), so they differ only in summation order, about
K * 2^-24 relative per dot product (K <= 512), far below 1e-4 and far below what one rounded weight would move
(a 4-bit step is 1/15 of a group's range)."""

from __future__ import annotations

import pytest
import torch

from loraledger.gpu import base_model
from loraledger.gpu.forward_batch import build_forward_batch, order_for_batch
from loraledger.gpu.kv_cache import KVCache
from loraledger.gpu.model import Model
from loraledger.gpu.ops_cuda import CudaOps
from loraledger.gpu.ops_torch import TorchOps
from loraledger.gpu.quant_projection import DeviceQuantProjection
from loraledger.lora.checkpoint_reader import load_lora_checkpoint
from loraledger.lora.device_slots import LoraSlots
from loraledger.scheduling.step_plan import SeqWork
from tests.gpu.cuda_emulation import EmulatedLauncher, emulation_problem

ADAPTERS = ["qv_r4", "all_r8", "ogd_r16_rslora"]
BLOCK, BLOCKS = 4, 48
F32 = torch.float32

PATHS = {  # the quantized tiny Llamas of tests/gpu/conftest.py: the kernel paths their parts run
    "ct-w4-g32-sym": {"w4a16"},
    "ct-w4-g64-asym": {"w4a16"},
    "ct-w4-g32-asym": {"w4a16"},
    "ct-w8-channel": {"w8a16"},
    "gptq-g_idx": {"w4a16"},
    "awq": {"w4a16"},
    "gptq-w8a16-g64": {"w8a16"},
    "bnb-int8": {"w8a16"},
    "Q4_0": {"w4a16"},
    "Q4_1": {"w4a16"},
    "Q8_0": {"w8a16"},
}
WITH_ADAPTERS = "ct-w4-g32-asym"


@pytest.fixture(scope="module")
def emulated() -> CudaOps:
    problem = emulation_problem()
    if problem is not None:
        pytest.skip(problem)
    return CudaOps("cpu", launcher=EmulatedLauncher(sm_count=4))


def _model(tiny, path, ops, *, device_layout: bool):
    config = base_model.read_config(path)
    scheme = base_model.read_quantization(path)
    weights = base_model.load_base(
        path, config, dtype=F32, device="cpu", quantization=scheme, device_layout=device_layout
    )
    slots = LoraSlots(config, max_loras=len(ADAPTERS), max_lora_rank=16, dtype=F32, device="cpu")
    for slot, name in enumerate(ADAPTERS):
        ckpt = load_lora_checkpoint(
            str(tiny.adapters[name]), lora_name=name, lora_int_id=slot + 1, model_config=config, max_lora_rank=16
        )
        slots.load(slot, ckpt)
    model = Model(config, weights, ops, lora_slots=slots, prepack=False)
    return model, weights, slots, KVCache(config, BLOCKS, BLOCK, F32, "cpu")


def _steps(model, slots, kv, ops, *, adapters: bool) -> list[torch.Tensor]:
    """A prefill of four sequences (17 rows), then one decode step of them; the logits of every step."""
    prompts = [([1, 5, 9, 200, 33], -1), ([1, 7, 7, 301], 0), ([1, 100, 101, 102, 103, 104], 1), ([1, 42], 2)]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(len(prompts))]
    out = []
    for step in range(2):
        works = []
        for sid, (prompt, slot) in enumerate(prompts):
            tokens, start = (prompt, 0) if step == 0 else ([60 + sid], len(prompt))
            slot = slot if adapters else -1
            works.append(SeqWork(sid, tokens, start, tables[sid], slot, sample=True, prompt_logprobs=True))
        ordered, num_decode = order_for_batch(works)
        batch, _ = build_forward_batch(
            ordered, num_decode, block_size=BLOCK, device=torch.device("cpu"), ops=ops, lora_slots=slots
        )
        out.append(model.forward(batch, kv))
    return out


@pytest.mark.parametrize("name", PATHS)
def test_quantized_forward_on_the_cuda_path_equals_the_cpu_fp32_forward(
    name, quantized_tiny_llama, tiny_llama, emulated
):
    path, paths = quantized_tiny_llama[name], PATHS[name]
    model, weights, slots, kv = _model(tiny_llama, path, emulated, device_layout=True)
    assert weights.dequantized == []
    projections = [p for lw in model.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down)]
    assert all(isinstance(p, DeviceQuantProjection) for p in projections)
    assert {path for p in projections for path in p.paths} == paths
    ref_model, _, ref_slots, ref_kv = _model(tiny_llama, path, TorchOps(), device_layout=False)
    adapters = name == WITH_ADAPTERS
    got = _steps(model, slots, kv, emulated, adapters=adapters)
    want = _steps(ref_model, ref_slots, ref_kv, TorchOps(), adapters=adapters)
    assert [g.shape[0] for g in got] == [17, 4]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4)


def test_nf4_is_dequantized_at_load_on_record(tiny_llama, quantized_tiny_llama, emulated):
    """bitsandbytes nf4 (a 16-level codebook the kernels cannot look up) runs dense in the model dtype, each
    projection named in the load's record."""
    model, weights, _, _ = _model(tiny_llama, quantized_tiny_llama["nf4"], emulated, device_layout=True)
    assert len(weights.dequantized) == 7 * tiny_llama.config.num_hidden_layers
    assert all("nf4 is a codebook" in line for line in weights.dequantized)
    assert all(p.dtype == F32 for lw in model.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down))


def test_the_runner_logs_every_projection_dequantized_at_load(quantized_tiny_llama):
    """What runs never changes silently: the ModelRunner names each projection it had to dequantize (here nf4 in
    bf16, where the weights would otherwise stay packed) in one warning at load, and keeps the list."""
    import structlog

    from loraledger.gpu.model_runner import ModelRunner

    path = quantized_tiny_llama["nf4"]
    with structlog.testing.capture_logs() as logged:
        runner = ModelRunner(
            path, dtype=torch.bfloat16, device=torch.device("cpu"), ops=TorchOps(), num_kv_blocks=8, block_size=4,
            max_loras=1, max_lora_rank=8, enable_lora=False, max_num_batched_tokens=64,
            quantization=base_model.read_quantization(path),
        )  # fmt: skip
    (event,) = [e for e in logged if e["event"].startswith("quantized projections dequantized at load")]
    assert event["log_level"] == "warning" and event["count"] == 14 == len(runner.dequantized_projections)
    assert "model.layers.0.self_attn.q_proj: bitsandbytes nf4 is a codebook" in event["projections"][0]
    runner.close()
