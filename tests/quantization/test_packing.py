"""Packed layouts: our packer and the unpackers agree with each format's documented bit layout."""

import pytest
import torch

from loraledger.errors import QuantizationError
from loraledger.quantization.packing import (
    compressed_tensors_pack,
    compressed_tensors_unpack,
    gptq_unpack,
    pack_int32,
    unpack_int32,
)


def test_bit_layout_lowest_first():
    values = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]])
    word = pack_int32(values, 4, dim=1)
    assert word.dtype == torch.int32 and int(word) & 0xFFFFFFFF == 0xF7654321
    assert torch.equal(unpack_int32(word, 4, dim=1), values.to(torch.int32))
    bytes8 = pack_int32(torch.tensor([[0x11, 0x22, 0x33, 0xFF]]), 8, dim=1)
    assert int(bytes8) & 0xFFFFFFFF == 0xFF332211


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_round_trip(bits, dim):
    values = torch.randint(0, 2**bits, (64, 32), generator=torch.Generator().manual_seed(bits + dim))
    assert torch.equal(unpack_int32(pack_int32(values, bits, dim), bits, dim), values.to(torch.int32))


def test_pack_refuses_a_ragged_dim():
    with pytest.raises(QuantizationError, match="multiple of 8"):
        pack_int32(torch.zeros(2, 12, dtype=torch.int64), 4, dim=1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, None])
@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_rtn_is_within_half_a_step(bits, group_size, symmetric):
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(7))
    t = compressed_tensors_pack(w, bits, group_size, symmetric)
    assert t["weight_packed"].shape == (16, 64 * bits // 32)
    assert ("weight_zero_point" in t) is not symmetric
    q, scale, zero = compressed_tensors_unpack(
        t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), bits, 64
    )
    g = group_size or 64
    deq = ((q.float().reshape(16, -1, g) - zero[..., None]) * scale[..., None]).reshape(16, 64)
    step = scale.repeat_interleave(g, dim=1)
    assert ((deq - w).abs() <= step * 0.5 + 1e-3).all()


def _gptq_pack(q_in_out, zeros_g_out, bits):
    """A GPTQ packer written from the format: qweight along the input dim, qzeros (stored zero - 1) along output."""
    return pack_int32(q_in_out, bits, dim=0), pack_int32(zeros_g_out - 1, bits, dim=1)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_desc_act_uses_g_idx(bits):
    gen = torch.Generator().manual_seed(3)
    k, n, g = 64, 16, 16
    q = torch.randint(0, 2**bits, (k, n), generator=gen)
    zeros = torch.randint(1, 2**bits, (k // g, n), generator=gen)
    scales = torch.rand(k // g, n, generator=gen).half() + 0.01
    g_idx = (torch.arange(k) // g)[torch.randperm(k, generator=gen)]  # activation order: columns shuffled
    qweight, qzeros = _gptq_pack(q, zeros, bits)
    got = gptq_unpack(qweight, qzeros, scales, g_idx, bits, g)
    want = torch.empty(n, k)
    for col in range(k):
        grp = int(g_idx[col])
        want[:, col] = (q[col] - zeros[grp]).float() * scales[grp].float()
    assert torch.equal(got, want)
    with pytest.raises(QuantizationError, match="g_idx"):
        gptq_unpack(qweight, qzeros, scales, g_idx + k, bits, g)


def test_awq_nibble_order_and_layer():
    from loraledger.quantization import QuantizedLinear
    from loraledger.quantization.packing import awq_unpack

    # one word: output columns 0..7 hold 0..7; nibble i holds column [0, 2, 4, 6, 1, 3, 5, 7][i]
    word = torch.tensor([[0x75316420]], dtype=torch.int32)
    q, scale, zero = awq_unpack(word.expand(128, 1).contiguous(), word, torch.ones(1, 8))
    assert torch.equal(q[:, 0], torch.arange(8, dtype=torch.int32)) and torch.equal(zero[:, 0], torch.arange(8.0))
    gen = torch.Generator().manual_seed(11)
    k, n, g = 256, 32, 128
    cols = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (k // g, n), generator=gen)
    scales = torch.rand(k // g, n, generator=gen) * 0.01 + 0.001
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    pack = lambda t: pack_int32(t.reshape(t.shape[0], -1, 8)[..., order].reshape(t.shape), 4, dim=1)  # noqa: E731
    q, scale, zero = awq_unpack(pack(cols), pack(zeros), scales)
    want = ((cols - zeros.repeat_interleave(g, 0)).float() * scales.repeat_interleave(g, 0)).t()
    layer = QuantizedLinear(q, scale, zero, 4)
    assert layer.path == "int4pack"
    assert torch.allclose(layer.dequantized(), want, atol=2e-3, rtol=1e-2)
    with pytest.raises(QuantizationError, match="one layer"):
        awq_unpack(pack(cols), pack(zeros), scales[:, :8])


@pytest.mark.parametrize("shuffled", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_grouped_runs_desc_act_on_the_kernels(bits, shuffled):
    from loraledger.quantization import QuantizedLinear
    from loraledger.quantization.packing import gptq_grouped

    gen = torch.Generator().manual_seed(13 + bits)
    k, n, g = 256, 32, 64
    q = torch.randint(0, 2**bits, (k, n), generator=gen)
    zeros = torch.randint(1, 2**bits, (k // g, n), generator=gen)
    scales = (torch.rand(k // g, n, generator=gen) * 0.01 + 0.001).half()
    g_idx = torch.arange(k) // g
    if shuffled:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    qweight, qzeros = _gptq_pack(q, zeros, bits)
    want = gptq_unpack(qweight, qzeros, scales, g_idx, bits, g)
    gq, scale, zero, perm = gptq_grouped(qweight, qzeros, scales, g_idx, bits, g)
    assert (perm is not None) is shuffled
    layer = QuantizedLinear(gq, scale, zero, bits, perm=perm)
    assert layer.path == ("int4pack" if bits == 4 else "dequantized")
    x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
    ref = x.float() @ want.t()
    assert torch.allclose(layer(x).float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())
    assert torch.allclose(layer.dequantized(), want, atol=2e-3 * float(want.abs().max()), rtol=2e-2)
    with pytest.raises(QuantizationError, match="columns in each"):
        gptq_grouped(qweight, qzeros, scales, torch.zeros(k, dtype=torch.int64), bits, g)


@pytest.mark.parametrize("bits", [4, 8])
def test_compressed_tensors_layout_is_its_librarys(bits):
    """weight_packed and the asymmetric zero points bit for bit as compressed-tensors' own pack_to_int32 writes them
    (40 rows: the zero points' packed dim is padded to a whole word); the older unpacked int8 zero points read alike."""
    helpers = pytest.importorskip(
        "compressed_tensors.compressors.pack_quantized.helpers",
        reason="compressed-tensors is in the test extra: pip install -e '.[test]'",
    )
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(bits))
    t = compressed_tensors_pack(w, bits, 32, False)
    q, scale, zero = compressed_tensors_unpack(t["weight_packed"], t["weight_scale"], t["weight_zero_point"], bits, 64)
    offset = 2 ** (bits - 1)
    assert torch.equal(helpers.pack_to_int32((q - offset).to(torch.int8), bits), t["weight_packed"])
    signed_zero = (zero - offset).to(torch.int8)
    assert torch.equal(helpers.pack_to_int32(signed_zero, bits, packed_dim=0), t["weight_zero_point"])
    assert torch.equal(compressed_tensors_unpack(t["weight_packed"], t["weight_scale"], signed_zero, bits, 64)[2], zero)
    with pytest.raises(QuantizationError, match="packed zero points"):
        compressed_tensors_unpack(t["weight_packed"], t["weight_scale"], t["weight_zero_point"][:-1], bits, 64)
