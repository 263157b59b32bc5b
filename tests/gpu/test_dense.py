"""Dense: the pre-packed oneDNN projection equals F.linear within fp32 rounding, at every batch size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraledger.gpu.dense import CHUNK_ROWS, Dense, padded_rows, prepack_supported

needs_prepack = pytest.mark.skipif(
    not prepack_supported("cpu", torch.float32), reason="this torch build has no oneDNN linear on the CPU"
)


@needs_prepack
@pytest.mark.parametrize("rows", [0, 1, 3, 5, 17, 32, 255, 256, 257, 600])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_matches_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=g) * 0.1
    bias = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(rows, 40, generator=g)
    dense = Dense(weight, bias, prepack=True)
    assert dense.prepacked and (dense.out_features, dense.in_features) == (96, 40)
    with torch.inference_mode():
        out = dense(x)
    assert out.shape == (rows, 96) and out.dtype == torch.float32 and out.is_contiguous()
    expect = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-5)


@needs_prepack
def test_prepacked_reads_strided_activations():
    weight = torch.randn(24, 16)
    wide = torch.randn(5, 40)
    x = wide[:, 8:24]  # rows with a stride larger than their width
    out = Dense(weight, prepack=True)(x)
    torch.testing.assert_close(out, F.linear(x.contiguous(), weight), rtol=1e-5, atol=1e-5)


def test_plain_dense_is_f_linear_and_keeps_the_weight():
    weight, bias = torch.randn(8, 4), torch.randn(8)
    x = torch.randn(3, 4)
    dense = Dense(weight, bias, prepack=False)
    assert not dense.prepacked
    assert torch.equal(dense(x), F.linear(x, weight, bias))


def test_prepack_is_refused_where_unsupported():
    assert not prepack_supported("cpu", torch.bfloat16)
    assert not prepack_supported("meta", torch.float32)
    with pytest.raises(ValueError, match="cannot pre-pack a torch.bfloat16 weight"):
        Dense(torch.randn(4, 4, dtype=torch.bfloat16), prepack=True)
    with pytest.raises(ValueError, match=r"2-D \[out, in\] weight"):
        Dense(torch.randn(4), prepack=False)
    with pytest.raises(ValueError, match="bias shape"):
        Dense(torch.randn(4, 2), torch.randn(3))


def test_only_a_fixed_set_of_row_counts_reaches_onednn():
    """oneDNN compiles and caches one primitive per shape: whatever the batch, Dense runs one of 37 row
    counts (bounded memory), never more than an eighth above the rows it was given past 16 rows."""
    sizes = {padded_rows(rows) for rows in range(1, CHUNK_ROWS + 1)}
    assert len(sizes) == 37 and max(sizes) == CHUNK_ROWS
    for rows in range(1, CHUNK_ROWS + 1):
        assert rows <= padded_rows(rows) <= max(16, rows * 1.125)


@needs_prepack
@pytest.mark.parametrize("rows", [1, 5, 17, 300])
def test_bf16_is_prepacked_only_where_the_cpu_multiplies_bf16_natively(rows, monkeypatch):
    from loraledger.gpu import cpu_features

    monkeypatch.setattr(cpu_features, "native_bf16", lambda: False)
    assert not prepack_supported("cpu", torch.bfloat16)
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: True)
    assert prepack_supported("cpu", torch.bfloat16) == cpu_features.bf16_reorder_possible()
    if not cpu_features.bf16_reorder_possible():
        pytest.skip("this CPU lacks what oneDNN's bf16 weight reorder needs (AVX512BW+VL+DQ or AVX-NE-CONVERT)")
    g = torch.Generator().manual_seed(rows)
    weight, bias = (torch.randn(96, 40, generator=g) * 0.1).bfloat16(), torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 40, generator=g).bfloat16()
    with torch.inference_mode():
        out = Dense(weight, bias, prepack=True)(x)
    assert out.shape == (rows, 96) and out.dtype == torch.bfloat16
    expect = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(out.double(), expect, rtol=1e-2, atol=1e-2)  # bf16 output rounding
