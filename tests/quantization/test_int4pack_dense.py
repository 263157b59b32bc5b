"""int4pack_dense: torch's int4pack bytes read back into the bf16 weight the int4 kernel computes with, and the
large-step product through it equal to its twin, F.linear on that weight."""

import pytest
import torch
import torch.nn.functional as F

from loraledger.quantization import QuantizedLinear, int4pack_dense
from loraledger.quantization.linear import LARGE_STEP_ROWS


def _weights(out: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, k), dtype=torch.int32, generator=g)
    scale = torch.rand(out, k // group, generator=g) * 0.05 + 0.01
    offset = -torch.rand(out, k // group, generator=g) * 0.4
    return q, scale, offset


def _twin_weight(layer: QuantizedLinear, q: torch.Tensor) -> torch.Tensor:
    """(q - 8) * scale + bias in fp32 from the layer's bf16 scales, rounded once to bf16: the int4 kernel's weight."""
    sz = layer._scales_and_zeros.float()  # [groups, out, 2]
    scale, bias = sz[..., 0].t(), sz[..., 1].t()
    out, k = q.shape
    w = (q.float().view(out, -1, layer.group_size) - 8.0) * scale[..., None] + bias[..., None]
    return w.view(out, k).to(torch.bfloat16)


def test_this_torch_writes_a_known_layout():
    assert int4pack_dense.layout() in ("split64", "split32", "pairs32")  # AVX512, AVX2, the rest


@pytest.mark.parametrize(("out", "k", "group"), [(176, 64, 32), (256, 128, 64), (48, 256, 128), (80, 512, 256)])
def test_the_packed_bytes_read_back_to_the_kernels_weight(out, k, group):
    q, scale, offset = _weights(out, k, group)
    layer = QuantizedLinear.from_affine(q, scale, offset, 4)
    assert layer.path == "int4pack"
    assert torch.equal(layer.dense_int4_weight(), _twin_weight(layer, q))
    # the kernel computes with that weight: one row through it equals the row through F.linear
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer._packed, group, layer._scales_and_zeros)
    want = F.linear(x, layer.dense_int4_weight()).float()
    # both round their output to bf16 after an fp32 sum in their own order: a bf16 ulp of the largest output
    torch.testing.assert_close(kernel.float(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


def test_a_large_step_runs_the_dense_product_equal_to_its_twin(monkeypatch):
    out, k, group = 208, 256, 64
    q, scale, offset = _weights(out, k, group, seed=3)
    layer = QuantizedLinear.from_affine(q, scale, offset, 4)
    x = torch.randn(LARGE_STEP_ROWS, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    calls = []
    monkeypatch.setattr(int4pack_dense, "linear", lambda *a: calls.append(a) or _real_linear(*a))
    got = layer(x)
    assert len(calls) == 1, "a step of LARGE_STEP_ROWS rows takes the dense product"
    twin = F.linear(x, _twin_weight(layer, q))
    torch.testing.assert_close(got, twin, rtol=1e-2, atol=1e-2)
    layer(x[: LARGE_STEP_ROWS - 1])
    assert len(calls) == 1, "fewer rows stay on the int4 kernel"
    # a weight bigger than the scratch runs in whole-block column chunks with the same result
    monkeypatch.setattr(int4pack_dense, "SCRATCH_BYTES", 2 * k * 64)
    assert torch.equal(_real_linear(x, layer._packed, layer._scales_and_zeros, group, out), got)


_real_linear = int4pack_dense.linear


def test_the_resident_weight_stays_packed():
    q, scale, offset = _weights(512, 512, 64)
    layer = QuantizedLinear.from_affine(q, scale, offset, 4)
    before = layer.resident_bytes()
    layer(torch.randn(LARGE_STEP_ROWS, 512).to(torch.bfloat16))
    assert layer.resident_bytes() == before <= 0.35 * 512 * 512 * 2


def _pack_pairs32(q: torch.Tensor) -> torch.Tensor:
    """torch's int4pack bytes as its non-AVX512 kernels write them: blocks of 32 rows, byte [k, j] = rows 2j, 2j + 1."""
    n, k = q.shape
    out = []
    for start in range(0, n, 32):
        block = q[start : start + 32].to(torch.uint8)  # [nb, k]
        pairs = block[0::2] | (block[1::2] << 4)  # [nb / 2, k]
        out.append(pairs.t().reshape(-1))
    return torch.cat(out).view(n, k // 2)


def test_the_other_layout_reads_back_too(monkeypatch):
    """The AVX2 / default layout, written here by hand, through the same reader and row lookup."""
    out, k, group = 80, 64, 32  # two 32-row blocks and a 16-row tail
    q, scale, offset = _weights(out, k, group, seed=4)
    layer = QuantizedLinear.from_affine(q, scale, offset, 4)
    monkeypatch.setattr(int4pack_dense, "layout", lambda: "pairs32")
    packed = _pack_pairs32(q)
    want = _twin_weight(layer, q)
    got = int4pack_dense.dense_weight(packed, layer._scales_and_zeros, group, out, k)
    assert torch.equal(got, want)
    rows = torch.tensor([0, 1, 31, 32, 63, 64, 79])
    read = int4pack_dense.read_rows(packed, layer._scales_and_zeros, group, out, k, rows)
    assert torch.equal(read.to(torch.bfloat16), want[rows])
