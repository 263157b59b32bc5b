"""KV-cache sizing from gpu_memory_utilization (gpu/kv_budget.py): vLLM's formula with made-up numbers, and the estimates."""

from __future__ import annotations

import pytest

from loraledger import errors as E
from loraledger.gpu import kv_budget
from loraledger.gpu.model_config import LORA_TARGETS

GIB = 1 << 30


def test_the_cache_gets_the_share_left_after_weights_activations_and_the_rest():
    """vLLM: requested = total * gpu_memory_utilization; KV cache = requested - (weights + activation peak + other)."""
    budget = kv_budget.kv_cache_budget(
        total_bytes=80 * GIB,
        free_bytes=79 * GIB,
        utilization=0.9,
        weights_bytes=16 * GIB,
        activation_peak_bytes=2 * GIB,
        other_bytes=GIB,
    )
    assert budget == int(80 * GIB * 0.9) - 19 * GIB
    lower = kv_budget.kv_cache_budget(
        total_bytes=80 * GIB,
        free_bytes=79 * GIB,
        utilization=0.5,
        weights_bytes=16 * GIB,
        activation_peak_bytes=2 * GIB,
        other_bytes=GIB,
    )
    assert lower == 40 * GIB - 19 * GIB


def test_less_free_memory_than_the_share_asked_for_is_refused():
    """vLLM: "Free memory on device ... on startup is less than desired GPU memory utilization"."""
    with pytest.raises(E.ConfigError, match="free memory on the device") as info:
        kv_budget.kv_cache_budget(
            total_bytes=80 * GIB, free_bytes=40 * GIB, utilization=0.9, weights_bytes=GIB, activation_peak_bytes=GIB
        )
    assert "gpu_memory_utilization=0.9" in str(info.value)


def test_no_room_left_for_the_cache_is_refused():
    """vLLM: "No available memory for the cache blocks. Try increasing gpu_memory_utilization"."""
    with pytest.raises(E.ConfigError, match="no memory is left for the KV cache"):
        kv_budget.kv_cache_budget(
            total_bytes=24 * GIB,
            free_bytes=24 * GIB,
            utilization=0.5,
            weights_bytes=11 * GIB,
            activation_peak_bytes=GIB,
        )


def test_weights_bytes_counts_the_checkpoints_tensors_at_the_engines_dtype(tiny_llama):
    from safetensors.torch import load_file

    tensors = load_file(str(tiny_llama.model_dir / "model.safetensors"))
    numel = sum(t.numel() for t in tensors.values())
    assert kv_budget.weights_bytes(tiny_llama.model_dir, 2) == 2 * numel
    assert kv_budget.weights_bytes(tiny_llama.model_dir, 4) == 4 * numel


def test_the_estimates_grow_with_the_token_budget_and_cover_the_slots(tiny_llama):
    config = tiny_llama.config
    small = kv_budget.activation_peak_bytes(config, max_num_batched_tokens=256, max_num_seqs=8, element_size=2)
    large = kv_budget.activation_peak_bytes(config, max_num_batched_tokens=8192, max_num_seqs=8, element_size=2)
    assert 0 < small < large
    assert large >= 8192 * config.intermediate_size * 3 * 2  # at least one layer's MLP activations
    shapes = config.module_shapes()
    per_slot = config.num_hidden_layers * sum(shapes[m][0] + shapes[m][1] for m in LORA_TARGETS) * 16 * 2
    assert kv_budget.lora_slots_bytes(config, max_loras=4, max_lora_rank=16, element_size=2) == 4 * per_slot
    assert kv_budget.cuda_graph_bytes(config, [1, 2, 4], with_lora=True) == 7 * config.vocab_size * 4 * 2
