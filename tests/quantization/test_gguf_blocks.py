"""GGUF blocks decoded into (q, scale, offset) equal the gguf package's own dequantization, and run on torch's
kernels where the layout fits."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from loraledger.errors import QuantizationError
from loraledger.quantization import QuantizedLinear
from loraledger.quantization.gguf_blocks import BLOCKS, decode


def _affine(q, scale, offset):
    rows, cols = q.shape
    g = cols // scale.shape[1]
    return (q.float().reshape(rows, -1, g) * scale[..., None] + offset[..., None]).reshape(rows, cols)


@pytest.mark.parametrize(("kind", "path"), [("Q4_0", "int4pack"), ("Q4_1", "int4pack"), ("Q8_0", "dequantized")])
def test_written_blocks_decode_to_the_packages_dequantization(kind, path):
    qtype = GGMLQuantizationType[kind]
    w = np.random.default_rng(5).standard_normal((16, 128)).astype(np.float32)
    raw = quants.quantize(w, qtype)
    want = torch.from_numpy(quants.dequantize(raw, qtype))
    q, scale, offset, bits = decode(raw, kind, 16, 128)
    assert torch.allclose(_affine(q, scale, offset), want, atol=1e-5)
    layer = QuantizedLinear.from_affine(q, scale, offset, bits)
    assert layer.path == path
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ref = x.float() @ want.t()
    assert torch.allclose(layer(x).float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())


def test_q4_k_random_blocks_decode_to_the_packages_dequantization():
    # the gguf package cannot write Q4_K, so random super-blocks with finite fp16 d / dmin stand in for a file
    rng = np.random.default_rng(9)
    raw = rng.integers(0, 256, size=(16, 2, 144), dtype=np.uint8)
    raw[..., 0:4] = np.frombuffer(rng.uniform(0.001, 0.01, 16 * 2 * 2).astype(np.float16).tobytes(), np.uint8).reshape(
        16, 2, 4
    )
    raw = raw.reshape(16, -1)
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_K))
    q, scale, offset, bits = decode(raw, "Q4_K", 16, 512)
    assert bits == 4 and scale.shape == (16, 16)
    assert torch.allclose(_affine(q, scale, offset), want, atol=1e-5, rtol=1e-5)
    layer = QuantizedLinear.from_affine(q, scale, offset, 4)
    assert layer.path == "int4pack"
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ref = x.float() @ want.t()
    assert torch.allclose(layer(x).float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())


def test_bad_shapes_and_types_are_refused():
    with pytest.raises(QuantizationError, match="only Q4_0"):
        decode(np.zeros(10, np.uint8), "Q5_K", 1, 32)
    with pytest.raises(QuantizationError, match="whole number"):
        decode(np.zeros(18, np.uint8), "Q4_0", 1, 48)
    with pytest.raises(QuantizationError, match="holds 17 bytes"):
        decode(np.zeros(17, np.uint8), "Q4_0", 1, 32)
    assert set(BLOCKS) == {"Q4_0", "Q4_1", "Q8_0", "Q4_K"}
