"""Prefill attention on the CPU through the decode kernel (TorchOps.prefill_attention for contexts up to
KERNEL_PREFILL_MAX_CONTEXT) against the SDPA path it replaces there and a float64 reference, on generated steps:
several sequences, chunks that follow a cached prefix, GQA groupings, head sizes off the vector width, block sizes,
sliding windows, softcaps, fp32 and bf16, q as a strided view of a fused qkv output. Longer contexts keep SDPA."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraledger.gpu import attention_cpu_kernel, ops_torch
from loraledger.gpu.ops_torch import TorchOps
from tests.gpu.cpu_kernel_marks import CPU_KERNEL_TESTS

pytestmark = CPU_KERNEL_TESTS


def _step(g, seq_lens, q_lens, hk, group, d, block_size, dtype):
    """A prefill step: each sequence's last q_lens[p] of seq_lens[p] tokens are queries, its keys are in the cache."""
    hq = hk * group
    width = max(-(-n // block_size) for n in seq_lens) + 1
    num_blocks = len(seq_lens) * width + 2
    k_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    for p, n in enumerate(seq_lens):
        need = -(-n // block_size)
        tables[p, :need] = perm[p * width : p * width + need].to(torch.int32)
    total = sum(q_lens)
    qkv = torch.randn(total, hq + 2 * hk, d, generator=g).to(dtype)
    starts = torch.tensor([0] + [sum(q_lens[: i + 1]) for i in range(len(q_lens))], dtype=torch.int32)
    return qkv[:, :hq], k_cache, v_cache, starts, torch.tensor(seq_lens, dtype=torch.int32), tables


def _exact(q, k_cache, v_cache, starts, seq_lens, tables, scale, window, softcap):
    hq, block_size, hk, d = q.shape[1], k_cache.shape[1], k_cache.shape[2], q.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for p in range(seq_lens.shape[0]):
        n, first, last = int(seq_lens[p]), int(starts[p]), int(starts[p + 1])
        blocks = tables[p, : -(-n // block_size)].long()
        keys = k_cache[blocks].reshape(-1, hk, d)[:n].double().repeat_interleave(hq // hk, dim=1)
        vals = v_cache[blocks].reshape(-1, hk, d)[:n].double().repeat_interleave(hq // hk, dim=1)
        for t in range(first, last):
            pos = n - (last - first) + (t - first)
            lo = max(0, pos + 1 - window) if window else 0
            s = torch.einsum("hd,lhd->hl", q[t].double(), keys[lo : pos + 1]) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            out[t] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), vals[lo : pos + 1])
    return out


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    chunks=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=5),  # (queries, prefix)
    hk=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4, 7]),
    d=st.sampled_from([3, 16, 40, 64, 128]),
    block_size=st.sampled_from([1, 5, 16]),
    window=st.sampled_from([None, 1, 9]),
    softcap=st.sampled_from([None, 5.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_kernel_prefill_equals_sdpa_and_exact_attention(seed, chunks, hk, group, d, block_size, window, softcap, dtype):
    g = torch.Generator().manual_seed(seed)
    q_lens = [c[0] for c in chunks]
    seq_lens = [c[0] + c[1] for c in chunks]
    q, k_cache, v_cache, starts, lens, tables = _step(g, seq_lens, q_lens, hk, group, d, block_size, dtype)
    scale = d**-0.5
    calls = []
    decode = attention_cpu_kernel.decode
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_cpu_kernel, "decode", lambda *a: calls.append(1) or decode(*a))
        got = TorchOps().prefill_attention(q, k_cache, v_cache, starts, lens, tables, scale, window, softcap=softcap)
        assert calls, "a context within KERNEL_PREFILL_MAX_CONTEXT must take the kernel"
        patch.setattr(ops_torch, "KERNEL_PREFILL_MAX_CONTEXT", 0)
        sdpa = TorchOps().prefill_attention(q, k_cache, v_cache, starts, lens, tables, scale, window, softcap=softcap)
        assert len(calls) == 1, "with the limit at 0 the SDPA path runs"
    exact = _exact(q, k_cache, v_cache, starts, lens, tables, scale, window, softcap)
    assert got.dtype == dtype and got.shape == q.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, sdpa, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    else:  # fp32 inside, rounded once: no further from the exact result than bf16 rounding of it, nor than SDPA
        bound = (exact - exact.to(torch.bfloat16).double()).abs() + 1e-6
        assert ((got.double() - exact).abs() <= bound + 2e-3 * exact.abs().clamp(min=1)).all()
        assert (got.double() - exact).abs().max() <= (sdpa.double() - exact).abs().max() + 1e-2


def test_longer_contexts_keep_sdpa(monkeypatch):
    g = torch.Generator().manual_seed(3)
    n = ops_torch.KERNEL_PREFILL_MAX_CONTEXT + 1
    q, k_cache, v_cache, starts, lens, tables = _step(g, [n, 4], [n, 4], 2, 2, 16, 16, torch.float32)
    monkeypatch.setattr(attention_cpu_kernel, "decode", lambda *a: pytest.fail("a longer context took the kernel"))
    got = TorchOps().prefill_attention(q, k_cache, v_cache, starts, lens, tables, 0.25)
    exact = _exact(q, k_cache, v_cache, starts, lens, tables, 0.25, None, None)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)


def test_int64_block_tables_keep_sdpa(monkeypatch):
    """The kernel reads int32 block ids: int64 tables (whose ids could wrap in a narrowing copy) keep the torch path."""
    g = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, starts, lens, tables = _step(g, [6, 3], [6, 3], 1, 2, 16, 4, torch.float32)
    monkeypatch.setattr(attention_cpu_kernel, "decode", lambda *a: pytest.fail("int64 tables took the kernel"))
    got = TorchOps().prefill_attention(q, k_cache, v_cache, starts, lens, tables.to(torch.int64), 0.25)
    exact = _exact(q, k_cache, v_cache, starts, lens, tables, 0.25, None, None)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
