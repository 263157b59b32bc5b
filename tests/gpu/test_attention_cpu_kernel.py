"""The CPU decode-attention kernel (gpu/attention_cpu_kernel.py) against its torch twin (TorchOps'
gathered_attention_decode) and a float64 reference, on generated batches: dtypes, head groupings, head sizes that
are not a multiple of the vector width, block sizes, context lengths, sliding windows, softcaps, q as a strided view
of a fused qkv row; and operands it must not read (out-of-range block ids or lengths) going to the torch path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraledger.gpu import attention_cpu_kernel, cpu_kernels
from loraledger.gpu.ops_torch import TorchOps
from tests.gpu.cpu_kernel_marks import CPU_KERNEL_TESTS

pytestmark = CPU_KERNEL_TESTS


def _case(seed, batch, hk, group, d, block_size, max_len, dtype, spare_blocks=3):
    g = torch.Generator().manual_seed(seed)
    hq = hk * group
    lens = torch.randint(1, max_len + 1, (batch,), generator=g, dtype=torch.int32)
    width = -(-max_len // block_size) + 1
    num_blocks = batch * width + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((batch, width), -1, dtype=torch.int32)  # unused entries stay -1, as the engine pads them
    for b in range(batch):
        need = -(-int(lens[b]) // block_size)
        tables[b, :need] = perm[b * width : b * width + need].to(torch.int32)
    qkv = torch.randn(batch, hq + 2 * hk, d, generator=g).to(dtype)  # q: a strided view, as the model hands it
    return qkv[:, :hq], k_cache, v_cache, tables, lens


def _reference(q, k_cache, v_cache, tables, lens, scale, window, softcap):
    """float64 attention of each sequence over its keys, from the same (rounded) operands."""
    hq, hk = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(lens[b])
        blocks = tables[b, : -(-n // block_size)].long()
        keys = k_cache[blocks].reshape(-1, hk, q.shape[2])[:n].double()
        vals = v_cache[blocks].reshape(-1, hk, q.shape[2])[:n].double()
        start = max(0, n - window) if window else 0
        keys, vals = keys[start:], vals[start:]
        keys = keys.repeat_interleave(hq // hk, dim=1)
        vals = vals.repeat_interleave(hq // hk, dim=1)
        s = torch.einsum("hd,lhd->hl", q[b].double(), keys) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        out[b] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), vals)
    return out


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(1, 6),
    hk=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 4, 7]),
    d=st.sampled_from([1, 3, 8, 12, 20, 33, 40, 64, 100, 128]),  # tails past 8 and 16 lanes
    block_size=st.sampled_from([1, 4, 5, 16, 32]),
    max_len=st.integers(1, 90),
    window=st.sampled_from([None, 1, 7, 33]),
    softcap=st.sampled_from([None, 5.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_kernel_equals_the_torch_path_and_the_exact_attention(
    seed, batch, hk, group, d, block_size, max_len, window, softcap, dtype
):
    q, k_cache, v_cache, tables, lens = _case(seed, batch, hk, group, d, block_size, max_len, dtype)
    scale = d**-0.5
    got = attention_cpu_kernel.decode(q, k_cache, v_cache, tables, lens, scale, window, softcap)
    assert got is not None and got.dtype == dtype and got.shape == q.shape
    twin = TorchOps().gathered_attention_decode(q, k_cache, v_cache, tables, lens, scale, window, softcap)
    exact = _reference(q, k_cache, v_cache, tables, lens, scale, window, softcap)
    if dtype == torch.float32:
        torch.testing.assert_close(got, twin, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    else:
        # fp32 inside, one rounding at the end: within half a bf16 step of the exact result, and no further
        # from it than the torch path (SDPA rounds its probabilities to bf16)
        err = (got.double() - exact).abs()
        assert bool((err <= exact.abs() * 2**-8 + 1e-6).all())
        assert err.max() <= (twin.double() - exact).abs().max() + 1e-6


def test_a_decode_step_of_the_bench_shape_runs_through_the_kernel(monkeypatch):
    """24 sequences of up to 100 tokens, 8 heads of 64, block size 16: TorchOps.paged_attention_decode runs the
    kernel (spied on), with the torch path's result."""
    q, k_cache, v_cache, tables, lens = _case(3, 24, 8, 1, 64, 16, 100, torch.float32)
    ran = []
    original = attention_cpu_kernel.decode
    monkeypatch.setattr(attention_cpu_kernel, "decode", lambda *a: ran.append(1) or original(*a))
    ops = TorchOps()
    got = ops.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(got, ops.gathered_attention_decode(q, k_cache, v_cache, tables, lens, 0.125))
    assert ran and original(q, k_cache, v_cache, tables, lens, 0.125, None, None) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_infinities_and_nans_as_the_torch_path(dtype):
    """A -inf score in the first block a head reads (no key of that block counts), a -inf in a later block, and a
    NaN key: the same finite values, or NaN, where the torch path gives them."""
    q, k_cache, v_cache, tables, lens = _case(6, 3, 1, 2, 8, 4, 12, dtype)
    lens = torch.tensor([7, 12, 9], dtype=torch.int32)
    tables = torch.arange(12, dtype=torch.int32).view(3, 4)  # every block each length needs
    q = torch.zeros_like(q)
    q[:, :, 0] = 1.0
    k_cache[tables[0, 0], :, 0, 0] = float("-inf")  # sequence 0: its whole first block scores -inf
    k_cache[tables[1, 2], 1, 0, 0] = float("-inf")  # sequence 1: one key of its last block
    k_cache[tables[2, 1], 0, 0, 0] = float("nan")  # sequence 2: a NaN score
    got = attention_cpu_kernel.decode(q, k_cache, v_cache, tables, lens, 0.5, None, None)
    twin = TorchOps().gathered_attention_decode(q, k_cache, v_cache, tables, lens, 0.5)
    assert torch.equal(torch.isnan(got), torch.isnan(twin))
    assert not torch.isnan(got[:2]).any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[:2].float(), twin[:2].float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "how", ["block id past the cache", "negative block id", "length past the table", "zero length"]
)
def test_operands_it_would_read_out_of_bounds_go_to_the_torch_path(how):
    q, k_cache, v_cache, tables, lens = _case(4, 3, 2, 2, 16, 4, 20, torch.float32, spare_blocks=0)
    lens = lens.clone()
    tables = tables.clone()
    lens[1] = 9
    if how == "block id past the cache":
        tables[1, 2] = k_cache.shape[0]
    elif how == "negative block id":
        tables[1, 0] = -1
    elif how == "length past the table":
        lens[1] = tables.shape[1] * k_cache.shape[1] + 1
    else:
        lens[1] = 0
    assert attention_cpu_kernel.decode(q, k_cache, v_cache, tables, lens, 0.25, None, None) is None


def test_other_operands_go_to_the_torch_path(monkeypatch):
    q, k_cache, v_cache, tables, lens = _case(5, 2, 2, 2, 16, 4, 12, torch.float32)
    assert (
        attention_cpu_kernel.decode(q.double(), k_cache.double(), v_cache.double(), tables, lens, 0.25, None, None)
        is None
    )
    assert (
        attention_cpu_kernel.decode(q, k_cache.bfloat16(), v_cache.bfloat16(), tables, lens, 0.25, None, None) is None
    )
    strided = k_cache.transpose(1, 2).contiguous().transpose(1, 2)  # not contiguous: the kernel reads rows in place
    assert attention_cpu_kernel.decode(q, strided, v_cache, tables, lens, 0.25, None, None) is None
    meta = v_cache.to("meta")  # another device: never a pointer the kernel reads
    assert attention_cpu_kernel.decode(q, k_cache, meta, tables, lens, 0.25, None, None) is None
    assert attention_cpu_kernel.decode(q, k_cache, v_cache, tables.to("meta"), lens, 0.25, None, None) is None
    assert attention_cpu_kernel.decode(q, k_cache, v_cache, tables, lens.to("meta"), 0.25, None, None) is None
    wide = tables.long()
    wide[0, 0] = 2**32 + int(tables[0, 0])  # int32 would wrap it onto a real block: int64 ids go to torch
    assert attention_cpu_kernel.decode(q, k_cache, v_cache, wide, lens, 0.25, None, None) is None
    for window, softcap in ((0, None), (-3, None), (None, 0.0), (None, -2.0)):  # not positive: torch's meaning
        assert attention_cpu_kernel.decode(q, k_cache, v_cache, tables, lens, 0.25, window, softcap) is None
    no_heads = k_cache[:, :, :0]
    assert attention_cpu_kernel.decode(q, no_heads, no_heads, tables, lens, 0.25, None, None) is None
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    assert attention_cpu_kernel.decode(q, k_cache, v_cache, tables, lens, 0.25, None, None) is None
    ops = TorchOps()
    torch.testing.assert_close(
        ops.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.25),
        ops.gathered_attention_decode(q, k_cache, v_cache, tables, lens, 0.25),
    )


def test_no_query_heads_is_not_the_kernels():
    """q with no heads is refused before the kernel (whose block prefetch divides the lines among the heads)."""
    k_cache = torch.zeros(2, 4, 1, 8)
    got = attention_cpu_kernel.decode(
        torch.zeros(1, 0, 8), k_cache, k_cache.clone(), torch.zeros(1, 2, dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32), 1.0, None, None,
    )  # fmt: skip
    assert got is None
