"""The KV-cache budget counts a quantized base's weights at the bytes the GPU's packed layout holds them in (from the
files' headers, before anything loads), so the memory 4-bit weights free goes to the KV cache."""

from __future__ import annotations

import pytest
import torch

from loraledger.gpu import base_model, kv_budget
from loraledger.gpu.packed_weight_bytes import dequantize_scratch_bytes
from loraledger.gpu.quant_projection import part_nbytes

F32 = 4  # bytes of the fp32 model dtype the loads below use

# counted exactly, else an upper bound: bitsandbytes int8's SCB / 127 is stored (and counted) fp32; the test's are fp16
# values, which the layout keeps in fp16. nf4 is dequantized at load: counted at the float size.
UPPER_BOUND = {"bnb-int8"}
NAMES = [
    "ct-w4-g32-sym",
    "ct-w4-g64-asym",
    "gptq-g_idx",
    "awq",
    "gptq-w8a16-g64",
    "bnb-int8",
    "nf4",
    "Q4_0",
    "Q4_1",
    "Q8_0",
]


def _loaded_bytes(path) -> tuple[int, int]:
    """(bytes of the projections as the device layout load holds them, bytes of every other tensor in fp32)."""
    config = base_model.read_config(path)
    scheme = base_model.read_quantization(path)
    w = base_model.load_base(path, config, dtype=torch.float32, device="cpu", quantization=scheme, device_layout=True)
    projections = sum(
        p.nbytes if isinstance(p, torch.Tensor) else sum(part_nbytes(x) for x in p)
        for lw in w.layers
        for p in (lw.qkv, lw.o, lw.gate_up, lw.down)
    )
    others = [w.embed, w.norm] + [t for lw in w.layers for t in (lw.input_norm, lw.post_norm)]
    if w.lm_head.data_ptr() != w.embed.data_ptr() and not config.tie_word_embeddings:
        others.append(w.lm_head)
    return projections, sum(t.numel() for t in others) * F32


@pytest.mark.parametrize("name", NAMES)
def test_weights_bytes_counts_the_packed_layout(name, quantized_tiny_llama):
    path = quantized_tiny_llama[name]
    counted = kv_budget.weights_bytes(path, F32, base_model.read_quantization(path))
    projections, others = _loaded_bytes(path)
    if name not in UPPER_BOUND:
        assert counted == projections + others
    else:
        assert projections + others <= counted <= (projections + others) * 1.1


def test_four_bit_weights_leave_the_kv_cache_the_memory_they_free(quantized_tiny_llama, tiny_llama):
    path = quantized_tiny_llama["ct-w4-g32-sym"]
    packed = kv_budget.weights_bytes(path, 2, base_model.read_quantization(path))
    dense = kv_budget.weights_bytes(tiny_llama.model_dir, 2)
    config = tiny_llama.config
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    projections = config.num_hidden_layers * (h * (q + 2 * kv) + q * h + 2 * i * h + i * h)
    # bf16 projections are 2 bytes an element; W4A16 g32 sym is half a byte plus a 2-byte scale per 32
    assert dense - packed == projections * 2 - projections * (0.5 + 2 / 32)
    budget = dict(total_bytes=1 << 30, free_bytes=1 << 30, utilization=0.5, activation_peak_bytes=1 << 20)
    gained = kv_budget.kv_cache_budget(weights_bytes=packed, **budget) - kv_budget.kv_cache_budget(
        weights_bytes=dense, **budget
    )
    assert gained == dense - packed


def test_the_prefill_dequantize_scratch_is_the_largest_fused_projection(tiny_llama):
    c = tiny_llama.config
    gate_up = c.hidden_size * 2 * c.intermediate_size
    assert dequantize_scratch_bytes(c.module_shapes(), 2) == 2 * max(
        gate_up, c.hidden_size * (c.q_size + 2 * c.kv_size), c.intermediate_size * c.hidden_size
    )
