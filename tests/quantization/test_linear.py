"""QuantizedLinear: torch's int4/int8 CPU kernels where the layout fits, dequantize-once elsewhere; each path
computes the dequantized weight's product."""

import pytest
import torch

from loraledger.errors import QuantizationError
from loraledger.quantization import QuantizedLinear
from loraledger.quantization.packing import compressed_tensors_pack, compressed_tensors_unpack


def _layer(bits, group_size, symmetric, out=32, k=256, **kw):
    w = torch.randn(out, k, generator=torch.Generator().manual_seed(bits * 7 + (group_size or 0)))
    t = compressed_tensors_pack(w, bits, group_size, symmetric)
    q, scale, zero = compressed_tensors_unpack(
        t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), bits, k
    )
    g = group_size or k
    ref = ((q.float().reshape(out, -1, g) - zero[..., None]) * scale[..., None]).reshape(out, k)
    return QuantizedLinear(q, scale, zero, bits, **kw), ref


@pytest.mark.parametrize(
    ("bits", "group_size", "symmetric", "path"),
    [
        (4, 32, True, "int4pack"),
        (4, 128, False, "int4pack"),
        (4, 16, True, "dequantized"),
        (4, None, True, "int4pack"),  # one group of all 256 columns
        (8, None, True, "int8pack"),
        (8, None, False, "dequantized"),
        (8, 64, True, "dequantized"),
    ],
)
def test_each_path_matches_the_dequantized_weight(bits, group_size, symmetric, path):
    layer, ref = _layer(bits, group_size, symmetric)
    assert layer.path == path
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = x.float() @ ref.t()
    got = layer(x).float()
    # bf16 activations and bf16 scales: relative error of a few bf16 ulps over a 256-long dot product
    assert torch.allclose(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item())
    fallback, _ = _layer(bits, group_size, symmetric, allow_kernel=False)
    assert fallback.path == "dequantized"
    assert torch.allclose(fallback(x).float(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


def test_int4_kernel_is_smaller_than_bf16():
    layer, _ = _layer(4, 128, True, out=256, k=512)
    assert layer.path == "int4pack"
    assert layer.resident_bytes() <= 0.35 * 256 * 512 * 2


def test_out_of_range_values_are_refused():
    q = torch.full((8, 32), 16, dtype=torch.int32)
    with pytest.raises(QuantizationError, match="outside"):
        QuantizedLinear(q, torch.ones(8, 1), torch.full((8, 1), 8.0), 4)
    with pytest.raises(QuantizationError, match="does not fit"):
        QuantizedLinear(q - 16, torch.ones(8, 3), torch.full((8, 3), 8.0), 4)
