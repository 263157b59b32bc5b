"""Fixtures the CUDA-path tests share: the tiny Llama quantized in every format the GPU's packed layout takes."""

from __future__ import annotations

import pytest

from tests.quantization.quantized_checkpoints import write_gguf, write_quantized

# name: (method, write_quantized arguments); GGUF files are named by their tensor type
QUANTIZED_FORMATS = {
    "ct-w4-g32-sym": ("compressed-tensors", dict(bits=4, group=32, sym=True)),
    "ct-w4-g32-asym": ("compressed-tensors", dict(bits=4, group=32, sym=False)),
    "ct-w4-g64-asym": ("compressed-tensors", dict(bits=4, group=64, sym=False)),
    "ct-w8-channel": ("compressed-tensors", dict(bits=8, group=None, sym=True)),
    "gptq-g_idx": ("gptq", dict(bits=4, group=32, sym=False, desc_act=True)),
    "gptq-w8a16-g64": ("gptq", dict(bits=8, group=64, sym=True)),
    "awq": ("awq", dict(bits=4, group=64, sym=False)),
    "bnb-int8": ("bitsandbytes", dict(bits=8, group=None, sym=True)),
    "nf4": ("bitsandbytes", dict(bits=4, group=64, sym=True)),
}
GGUF_KINDS = ("Q4_0", "Q4_1", "Q8_0")


@pytest.fixture(scope="session")
def quantized_tiny_llama(tiny_llama, tmp_path_factory) -> dict:
    """name -> the quantized checkpoint folder or GGUF file of the tiny Llama."""
    root = tmp_path_factory.mktemp("quantized-tiny-llama")
    out = {name: write_quantized(tiny_llama.model_dir, root, m, **kw)[0] for name, (m, kw) in QUANTIZED_FORMATS.items()}
    for kind in GGUF_KINDS:
        out[kind] = write_gguf(tiny_llama.model_dir, root / f"tiny.{kind}.gguf", kind)
    return out
