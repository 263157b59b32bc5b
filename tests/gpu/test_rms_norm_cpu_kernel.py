"""The CPU residual-add + RMSNorm kernel (gpu/rms_norm_cpu_kernel.py) against its torch twin (TorchOps.plain_rms_norm)
on generated rows: widths that are not a multiple of the vector width, strided rows, with and without a residual,
fp32 and bf16; operands it does not take go to the torch path."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraledger.gpu import cpu_kernels, rms_norm_cpu_kernel
from loraledger.gpu.ops_torch import TorchOps
from tests.gpu.cpu_kernel_marks import CPU_KERNEL_TESTS

pytestmark = CPU_KERNEL_TESTS


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 40),
    n=st.integers(1, 200),
    pad=st.integers(0, 9),
    residual=st.booleans(),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_kernel_equals_the_torch_path(seed, rows, n, pad, residual, scale, dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n + pad, generator=g) * scale).to(dtype)[:, :n]  # rows n + pad apart
    res = (torch.randn(rows, n + pad, generator=g) * scale).to(dtype)[:, :n] if residual else None
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    got = rms_norm_cpu_kernel.rms_norm(x, w, 1e-6, res)
    assert got is not None
    out, r = got
    want_out, want_r = TorchOps().plain_rms_norm(x, w, 1e-6, res)
    assert out.dtype == dtype and r.dtype == dtype
    # the residual stream is the same add in the same dtype: bit-equal
    assert torch.equal(r, want_r)
    if residual is False:
        assert r is x
    if dtype == torch.float32:
        torch.testing.assert_close(out, want_out, rtol=2e-6, atol=1e-6)
    else:  # the fp32 norm differs in its last bits at most: one bf16 step apart where it rounds the other way
        torch.testing.assert_close(out.float(), want_out.float(), rtol=2**-7, atol=1e-6)


def test_the_ops_use_it_on_the_cpu_and_torch_elsewhere(monkeypatch):
    x, w = torch.randn(3, 64), torch.rand(64) + 0.5
    ran = []
    original = rms_norm_cpu_kernel.rms_norm
    monkeypatch.setattr(rms_norm_cpu_kernel, "rms_norm", lambda *a: ran.append(1) or original(*a))
    ops = TorchOps()
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5)[0], ops.plain_rms_norm(x, w, 1e-5)[0])
    assert ran and original(x, w, 1e-5, None) is not None
    assert rms_norm_cpu_kernel.rms_norm(x.double(), w.double(), 1e-5, None) is None
    assert rms_norm_cpu_kernel.rms_norm(x, w.bfloat16(), 1e-5, None) is None  # a weight of another dtype
    assert rms_norm_cpu_kernel.rms_norm(x, w[:32], 1e-5, None) is None
    assert rms_norm_cpu_kernel.rms_norm(x.t().contiguous().t(), w, 1e-5, None) is None  # columns strided
    assert rms_norm_cpu_kernel.rms_norm(x, w.to("meta"), 1e-5, None) is None  # another device
    assert rms_norm_cpu_kernel.rms_norm(x, w, 1e-5, x.t().contiguous().t()) is None  # a residual with strided columns


def test_switched_off_it_leaves_the_work_to_torch(monkeypatch):
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    x, w = torch.randn(3, 64), torch.rand(64) + 0.5
    assert rms_norm_cpu_kernel.rms_norm(x, w, 1e-5, None) is None
    ops = TorchOps()
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5, x)[0], ops.plain_rms_norm(x, w, 1e-5, x)[0])
