"""Fixtures the CUDA-path tests share: the tiny Llama quantized in every format the GPU's packed layout takes."""

from __future__ import annotations

import pytest

from tests.quantization.quantized_checkpoints import GGUF_KINDS, QUANTIZED_FORMATS, write_gguf, write_quantized

# the formats the GPU's packed layout takes (nf4: dequantized at load, on record)
GPU_FORMATS = ("ct-w4-g32-sym", "ct-w4-g32-asym", "ct-w4-g64-asym", "ct-w8-channel", "gptq-g_idx", "gptq-w8a16-g64",
               "awq", "bnb-int8", "nf4")  # fmt: skip


@pytest.fixture(scope="session")
def quantized_tiny_llama(tiny_llama, tmp_path_factory) -> dict:
    """name -> the quantized checkpoint folder or GGUF file of the tiny Llama."""
    root = tmp_path_factory.mktemp("quantized-tiny-llama")
    out = {}
    for name in GPU_FORMATS:
        method, kwargs = QUANTIZED_FORMATS[name]
        out[name] = write_quantized(tiny_llama.model_dir, root, method, **kwargs)[0]
    for kind in GGUF_KINDS:
        out[kind] = write_gguf(tiny_llama.model_dir, root / f"tiny.{kind}.gguf", kind)
    return out


@pytest.fixture
def fresh_cpu_kernels():
    """Every CPU kernel looked up anew, before and after the test: none cached from an earlier one."""
    from loraledger.gpu import cpu_kernels, lora_cpu_kernel

    caches = (
        cpu_kernels.library,
        cpu_kernels.function,
        lora_cpu_kernel.load,
    )
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()
