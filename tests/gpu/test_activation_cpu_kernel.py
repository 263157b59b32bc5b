"""The CPU SiLU-and-multiply kernel (gpu/activation_cpu_kernel.py) against its torch twin
(TorchOps.plain_silu_and_mul) on generated rows: widths that are not a multiple of the vector width, strided rows,
large and special inputs, fp32 and bf16; steps past its size bound and other operands go to the torch path."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraledger.gpu import activation_cpu_kernel, cpu_kernels
from loraledger.gpu.ops_torch import TorchOps
from tests.gpu.cpu_kernel_marks import CPU_KERNEL_TESTS

pytestmark = CPU_KERNEL_TESTS


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 24),
    i=st.integers(1, 150),
    pad=st.integers(0, 5),
    scale=st.sampled_from([0.1, 4.0, 60.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_kernel_equals_the_torch_path(seed, rows, i, pad, scale, dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2 * i + pad, generator=g) * scale).to(dtype)[:, : 2 * i]
    got = activation_cpu_kernel.silu_and_mul(x)
    assert got is not None and got.dtype == dtype and got.shape == (rows, i)
    want = TorchOps().plain_silu_and_mul(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:  # silu in fp32 differs in its last bits: one bf16 step apart at most, where it rounds the other way
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)


def test_special_values():
    gate = torch.tensor(
        [0.0, -0.0, 1e-30, -1e-30, 88.0, 89.0, -88.0, -89.0, -200.0, 200.0, float("inf"), float("-inf")]
    )
    x = torch.cat([gate, torch.full_like(gate, 2.0)])[None]
    got, want = activation_cpu_kernel.silu_and_mul(x), TorchOps().plain_silu_and_mul(x)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30, equal_nan=True)
    nan = torch.tensor([[float("nan"), 1.0]])
    assert torch.isnan(activation_cpu_kernel.silu_and_mul(nan)).all()


def test_other_operands_go_to_torch(monkeypatch):
    big = torch.randn(activation_cpu_kernel.MAX_ELEMENTS // 8 + 1, 16)  # one output past the bound
    assert activation_cpu_kernel.silu_and_mul(big) is None
    assert activation_cpu_kernel.silu_and_mul(torch.randn(3, 9)) is None  # odd width
    assert activation_cpu_kernel.silu_and_mul(torch.randn(3, 8).double()) is None
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    assert activation_cpu_kernel.silu_and_mul(torch.randn(3, 8)) is None
    x = torch.randn(3, 8)
    torch.testing.assert_close(TorchOps().silu_and_mul(x), TorchOps().plain_silu_and_mul(x))


def test_the_ops_use_it_on_the_cpu(monkeypatch):
    ran = []
    original = activation_cpu_kernel.silu_and_mul
    monkeypatch.setattr(activation_cpu_kernel, "silu_and_mul", lambda x: ran.append(1) or original(x))
    x = torch.randn(5, 64)
    torch.testing.assert_close(TorchOps().silu_and_mul(x), TorchOps().plain_silu_and_mul(x), rtol=2e-6, atol=1e-6)
    assert ran and original(x) is not None


def test_silu_is_accurate_across_the_float_range():
    """A sweep of the gate over e^x's whole finite range: the vector exp (gpu/kernels/cpu_vectors.h) and the division
    stay within a few fp32 steps of the float64 SiLU (torch's own is within ~1.5e-7)."""
    gate = torch.linspace(-87.0, 88.0, 20_001)
    x = torch.cat([gate, torch.ones_like(gate)])[None]
    got = activation_cpu_kernel.silu_and_mul(x)[0].double()
    exact = gate.double() * torch.sigmoid(gate.double())
    assert float(((got - exact).abs() / exact.abs().clamp_min(1e-30)).max()) < 1e-6
