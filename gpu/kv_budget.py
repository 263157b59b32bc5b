"""KV-cache sizing on CUDA from gpu_memory_utilization, as vLLM does it: a pure function plus the estimates it takes.

vLLM (v1 GPU worker): the engine may use `total * gpu_memory_utilization` bytes of the device; the
weights, the activation peak of the largest step and other non-KV memory are taken from that, and
the KV cache gets the rest. At start the device must have that much free, else it refuses
("Free memory on device ... is less than desired GPU memory utilization"); if nothing is left for
the cache it refuses too ("No available memory for the cache blocks"). vLLM profiles the peak
with a dummy forward pass; here it is estimated from the model's shapes (activation_peak_bytes),
which needs no weights loaded before the cache is sized.
"""

from __future__ import annotations

from pathlib import Path

from loraledger.errors import ConfigError
from loraledger.gpu.model_config import LORA_TARGETS, ModelConfig
from loraledger.quantization.scheme import QuantScheme

GIB = 1 << 30


def kv_cache_budget(
    *,
    total_bytes: int,
    free_bytes: int,
    utilization: float,
    weights_bytes: int,
    activation_peak_bytes: int,
    other_bytes: int = 0,
) -> int:
    """Bytes for the KV cache: total_bytes * utilization minus weights, activation peak and other memory.

    total_bytes / free_bytes: the device's memory and what is free at start (torch.cuda.mem_get_info);
    other_bytes: what else the engine keeps on the device (adapter slots, CUDA graph outputs).
    Raises ConfigError when the device has less free than the share asked for, or nothing is left.
    """
    requested = int(total_bytes * utilization)
    if free_bytes < requested:
        raise ConfigError(
            f"free memory on the device ({free_bytes / GIB:.2f}/{total_bytes / GIB:.2f} GiB) at start is less than "
            f"gpu_memory_utilization={utilization} asks for ({requested / GIB:.2f} GiB); lower gpu_memory_utilization "
            "or free the memory other processes use"
        )
    available = requested - weights_bytes - activation_peak_bytes - other_bytes
    if available <= 0:
        raise ConfigError(
            f"no memory is left for the KV cache: gpu_memory_utilization={utilization} gives {requested / GIB:.2f} GiB, and "
            f"the weights ({weights_bytes / GIB:.2f} GiB), the activation peak ({activation_peak_bytes / GIB:.2f} GiB) and "
            f"the rest ({other_bytes / GIB:.2f} GiB) take it all; raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return available


def weights_bytes(model_dir: str | Path, element_size: int, quantization: QuantScheme | None = None) -> int:
    """Device bytes of the checkpoint's tensors once cast to a dtype of `element_size` bytes (from the headers only);
    a quantized checkpoint's (or GGUF file's) projections at the bytes of the GPU's packed layout that CUDA keeps them
    in (gpu/packed_weight_bytes.py), not at a float size."""
    from safetensors import safe_open

    from loraledger.gpu import packed_weight_bytes
    from loraledger.gpu.gguf_weights import is_gguf
    from loraledger.gpu.weights import weight_files

    if is_gguf(model_dir):
        return packed_weight_bytes.gguf_packed_bytes(Path(model_dir), element_size)
    if quantization is not None and not quantization.quantized_at_load:
        return packed_weight_bytes.safetensors_packed_bytes(weight_files(model_dir), quantization, element_size)
    numel = 0
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                count = 1
                for dim in f.get_slice(name).get_shape():
                    count *= dim
                numel += count
    return numel * element_size


def activation_peak_bytes(
    config: ModelConfig, *, max_num_batched_tokens: int, max_num_seqs: int, element_size: int
) -> int:
    """An upper estimate of a step's transient memory: one layer's activations for the token budget, plus the
    sampler's fp32/fp64 [rows, vocab] tensors (logits, processed logits, the Gumbel noise and its uniforms)."""
    tokens = max_num_batched_tokens
    per_token = 4 * config.hidden_size + config.q_size + 2 * config.kv_size + 3 * config.intermediate_size
    layer = tokens * per_token * element_size
    rows = min(max_num_seqs, tokens)
    sampler = rows * config.vocab_size * (4 + 4 + 8 + 8 + 4)
    return layer + sampler


def lora_slots_bytes(config: ModelConfig, *, max_loras: int, max_lora_rank: int, element_size: int) -> int:
    """Device bytes of the adapter slots: A and B of every target module, every layer, every slot, at max_lora_rank."""
    shapes = config.module_shapes()
    per_layer = sum((shapes[m][0] + shapes[m][1]) * max_lora_rank for m in LORA_TARGETS)
    return config.num_hidden_layers * max_loras * per_layer * element_size


def cuda_graph_bytes(config: ModelConfig, capture_sizes: list[int], *, with_lora: bool) -> int:
    """The fp32 logits outputs the decode graphs keep ([size, vocab] per captured size, with and without LoRA)."""
    return sum(capture_sizes) * config.vocab_size * 4 * (2 if with_lora else 1)
