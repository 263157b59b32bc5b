"""The GPU's packed layout: compressed-tensors, GPTQ, AWQ, bitsandbytes int8 and GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K convert
to it exactly (its dequantized weight equals each format's own, bit for bit in fp32, on generated shapes and groups),
and what the kernels cannot read is refused."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from loraledger.errors import QuantizationError
from loraledger.quantization.device_layout import from_affine, from_zero_point, unpack_rows
from loraledger.quantization.gguf_blocks import decode
from loraledger.quantization.packing import (
    AWQ_ORDER,
    awq_unpack,
    compressed_tensors_pack,
    compressed_tensors_unpack,
    gptq_grouped,
    gptq_unpack,
    pack_int32,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_converts_exactly(bits, group_size, symmetric):
    w = torch.randn(24, 256, generator=_gen(bits + (group_size or 0)))
    t = compressed_tensors_pack(w, bits, group_size, symmetric)
    q, scale, zero = compressed_tensors_unpack(
        t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), bits, 256
    )
    dev = from_zero_point(q, scale, zero, bits, scale_dtype=t["weight_scale"].dtype)
    assert dev.scales.dtype == torch.float16 and dev.group_size == (group_size or 256)
    assert (dev.zeros is None) == symmetric and dev.offsets is None
    # 4-bit: the device words are compressed-tensors' own weight_packed words
    assert torch.equal(dev.qweight, t["weight_packed"])
    g = dev.group_size
    want = ((q.float().reshape(24, -1, g) - zero[..., None]) * scale[..., None]).reshape(24, 256)
    assert torch.equal(dev.dequantize(), want)


def _gptq_tensors(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int):
    """GPTQ's checkpoint tensors for q [out, in], integer zeros and scales [groups, out] (qzeros stored as zero - 1)."""
    qweight = pack_int32(q.t(), bits, dim=0)
    qzeros = pack_int32((zeros - 1) % 2**bits, bits, dim=1)
    return qweight, qzeros, scales


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_converts_exactly_with_and_without_desc_act(bits, desc_act):
    out, k, group = 16, 256, 64
    g = _gen(bits * 10 + desc_act)
    q = torch.randint(0, 2**bits, (out, k), generator=g)
    zeros = torch.randint(1, 2**bits, (k // group, out), generator=g)
    scales = (torch.rand(k // group, out, generator=g) * 0.1 + 0.01).to(torch.float16)
    g_idx = torch.randperm(k, generator=g) % (k // group) if desc_act else None
    qweight, qzeros, scales = _gptq_tensors(q, zeros, scales, bits)
    want = gptq_unpack(qweight, qzeros, scales, g_idx, bits, group)
    qs, scale, zero, perm = gptq_grouped(qweight, qzeros, scales, g_idx, bits, group)
    dev = from_zero_point(qs, scale, zero, bits, scale_dtype=torch.float16, perm=perm)
    assert (dev.perm is not None) == desc_act
    got = dev.dequantize()
    if perm is not None:
        got = torch.empty_like(got).index_copy_(1, perm, got)  # back to the checkpoint's column order
    assert torch.equal(got, want)


def test_awq_converts_exactly():
    out, k, group = 32, 256, 128
    g = _gen(3)
    q = torch.randint(0, 16, (out, k), generator=g)
    zeros = torch.randint(0, 16, (k // group, out), generator=g)
    scales = (torch.rand(k // group, out, generator=g) * 0.1 + 0.01).to(torch.float16)

    def awq_pack(columns: torch.Tensor) -> torch.Tensor:  # [rows, out] -> [rows, out / 8] in AWQ's nibble order
        rows = columns.shape[0]
        return pack_int32(columns.reshape(rows, -1, 8)[..., list(AWQ_ORDER)].reshape(rows, -1), 4, dim=1)

    qs, scale, zero = awq_unpack(awq_pack(q.t().contiguous()), awq_pack(zeros), scales)
    dev = from_zero_point(qs, scale, zero, 4, scale_dtype=torch.float16)
    want = (q.float() - zeros.t().float().repeat_interleave(group, 1)) * scales.t().float().repeat_interleave(group, 1)
    assert torch.equal(dev.dequantize(), want)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_0_and_q4_1_convert_exactly(kind):
    qtype = GGMLQuantizationType[kind]
    w = np.random.default_rng(7).standard_normal((12, 256)).astype(np.float32)
    raw = quants.quantize(w, qtype)
    want = torch.from_numpy(quants.dequantize(raw, qtype))
    q, scale, offset, bits = decode(raw, kind, 12, 256)
    dev = from_affine(q, scale, offset, bits, scale_dtype=torch.float16)
    assert dev.group_size == 32 and dev.scales.dtype == torch.float16 and dev.zeros is None
    if kind == "Q4_0":
        assert dev.offsets is None and dev.zero == 8.0
    else:
        assert dev.offsets is not None and dev.zero == 0.0
    assert torch.equal(unpack_rows(dev.qweight, 4), q.to(torch.int64))
    assert torch.equal(dev.dequantize(), want)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_common_affine_form_gets_its_zero_points_back(bits):
    """offset = -zero * scale in fp32 (how the CPU path holds GPTQ / AWQ / compressed-tensors) converts to integer
    zero points, not to offsets a 16-bit float could not hold."""
    g = _gen(40 + bits)
    q = torch.randint(0, 2**bits, (8, 128), generator=g)
    scale = (torch.rand(8, 4, generator=g) * 0.1 + 0.01).to(torch.float16).float()
    zero = torch.randint(0, 2**bits + 1, (8, 4), generator=g).float()
    scale[0, 0] = 0.0  # an all-zero group
    perm = torch.randperm(128, generator=g)
    dev = from_affine(q, scale, -zero * scale, bits, scale_dtype=torch.float16, perm=perm)
    assert dev.offsets is None and dev.zeros is not None and dev.perm is perm
    want = ((q.float().reshape(8, 4, -1) - zero[..., None]) * scale[..., None]).reshape(8, 128)
    assert torch.equal(dev.dequantize(), want)
    uniform = from_affine(q, scale, -3.0 * scale, bits)
    assert uniform.zeros is None and uniform.offsets is None and uniform.zero == 3.0


def test_scales_a_16_bit_float_cannot_hold_are_kept_in_fp32():
    q = torch.randint(0, 16, (2, 64), generator=_gen(5))
    scale = torch.tensor([[1 + 2**-10, 1.0], [1.0, 1.0]]) * 3  # 11 significant bits times 3: neither fp16 nor bf16
    offset = -scale * 0.37
    dev = from_affine(q, scale, offset, 4)
    assert dev.scales.dtype == torch.float32 and dev.offsets.dtype == torch.float32
    assert torch.equal(
        dev.dequantize(), (q.float().reshape(2, 2, 32) * scale[..., None] + offset[..., None]).reshape(2, 64)
    )
    assert from_zero_point(q, scale, torch.full_like(scale, 8.0), 4).scales.dtype == torch.float32
    with pytest.raises(QuantizationError, match="NaN"):
        from_zero_point(q, torch.full_like(scale, float("nan")), torch.full_like(scale, 8.0), 4)


def _k_quant_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    from tests.quantization.quantized_checkpoints import encode_q4_k

    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return encode_q4_k(w)


@pytest.mark.parametrize(("rows", "cols"), [(4, 256), (3, 512), (9, 768)])
def test_gguf_q4_k_converts_exactly_with_fp32_scales_and_mins(rows, cols):
    """Q4_K's per-32 scale d * sc and min dmin * m (fp16 times a 6-bit integer: up to 17 significant bits) fit fp32,
    not bf16 or fp16: the layout keeps them fp32, and its weight is the gguf package's own dequantization."""
    raw = _k_quant_blocks(rows, cols, rows + cols)
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_K))
    q, scale, offset, bits = decode(raw, "Q4_K", rows, cols)
    dev = from_affine(q, scale, offset, bits)
    assert dev.group_size == 32 and dev.offsets is not None and dev.scales.dtype == torch.float32
    assert not torch.equal(scale.to(torch.bfloat16).float(), scale) and not torch.equal(scale.half().float(), scale)
    assert torch.equal(dev.dequantize(), want)


@pytest.mark.parametrize("seed", range(3))
def test_gguf_q8_0_is_an_8_bit_group_32_weight_with_zero_128(seed):
    rng = np.random.default_rng(seed)
    rows, cols = int(rng.integers(1, 9)), 32 * int(rng.integers(1, 9))
    raw = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), GGMLQuantizationType.Q8_0)
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q8_0))
    q, scale, offset, bits = decode(raw, "Q8_0", rows, cols)
    dev = from_affine(q, scale, offset, bits)
    assert (dev.bits, dev.group_size, dev.zero, dev.zeros, dev.offsets) == (8, 32, 128.0, None, None)
    assert dev.scales.dtype == torch.float16
    assert torch.equal(dev.dequantize(), want)


@pytest.mark.parametrize("seed", range(4))
def test_bitsandbytes_int8_rows_convert_exactly(seed):
    """int8 [N, K] with one fp32 SCB a row: W = int8 * SCB / 127, an 8-bit weight with one group a row and zero
    128; SCB / 127 in fp32 is rarely a 16-bit value, so the scales stay fp32."""
    from loraledger.quantization.projection_reader import read_module
    from loraledger.quantization.scheme import QuantScheme

    g = _gen(60 + seed)
    n, k = int(torch.randint(1, 12, (1,), generator=g)), 16 * int(torch.randint(1, 9, (1,), generator=g))
    w8 = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
    scb = torch.rand(n, generator=g) * 3
    tensors = {"m.weight": w8, "m.SCB": scb}
    scheme = QuantScheme(method="bitsandbytes", bits=8, group_size=None, symmetric=True, weight_type="int8")
    part = read_module(scheme, "m", tensors.__getitem__, tensors.__contains__)
    dev = from_affine(part.q, part.scale, part.offset, part.bits)
    assert (dev.group_size, dev.zero, dev.zeros, dev.offsets) == (k, 128.0, None, None)
    assert torch.equal(dev.dequantize(), w8.float() * (scb / 127.0)[:, None])


def test_bf16_scales_stay_bf16_and_fp32_scales_take_the_16_bit_type_that_holds_them():
    q = torch.randint(0, 16, (4, 64), generator=_gen(1))
    bf = torch.rand(4, 2, generator=_gen(2)).to(torch.bfloat16)
    assert from_zero_point(q, bf.float(), torch.full((4, 2), 8.0), 4, scale_dtype=torch.bfloat16).scales.dtype == (
        torch.bfloat16
    )
    odd_bf16 = torch.tensor([[2.0**-30, 3.0]] * 4)  # below fp16's smallest subnormal: only bf16 holds it
    assert from_zero_point(q, odd_bf16, torch.full((4, 2), 8.0), 4).scales.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("q", "scale", "bits", "match"),
    [
        (torch.zeros(2, 48, dtype=torch.int32), torch.ones(2, 3), 4, "group size 16 is not a multiple of 32"),
        (torch.zeros(2, 64, dtype=torch.int32), torch.ones(2, 2), 3, "4- or 8-bit"),
        (torch.full((2, 64), 16, dtype=torch.int32), torch.ones(2, 2), 4, r"outside \[0, 16\)"),
        (torch.zeros(2, 64, dtype=torch.int32), torch.ones(3, 2), 4, "does not fit"),
    ],
)
def test_layouts_the_kernels_cannot_read_are_refused(q, scale, bits, match):
    with pytest.raises(QuantizationError, match=match):
        from_zero_point(q, scale, torch.zeros_like(scale), bits)


def test_zero_points_must_be_integers_in_range():
    q = torch.zeros(2, 64, dtype=torch.int32)
    with pytest.raises(QuantizationError, match="integers"):
        from_zero_point(q, torch.ones(2, 2), torch.full((2, 2), 7.5), 4)
