"""The CPU rotary kernel (gpu/rotary_cpu_kernel.py) against its torch twin (TorchOps.plain_rotary_embedding) on
generated operands: bit for bit in fp32 and bf16, q and k as views of one fused qkv output (rotated as one) and
apart, head sizes whose half is not a multiple of the vector width, positions anywhere in the table; a position
outside the table is refused before anything is written; other operands go to the torch path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraledger.errors import KernelInputError
from loraledger.gpu import cpu_kernels, rotary_cpu_kernel
from loraledger.gpu.ops_torch import TorchOps
from tests.gpu.cpu_kernel_marks import CPU_KERNEL_TESTS

pytestmark = CPU_KERNEL_TESTS


def _qkv(g, tokens, hq, hk, d, dtype, scale):
    """A fused qkv output [T, (hq + 2 hk) d] and q, k as the model views them."""
    qkv = (torch.randn(tokens, (hq + 2 * hk) * d, generator=g) * scale).to(dtype)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    return qkv, q, k


def _table(g, positions, d):
    return torch.randn(positions, d, generator=g)  # any values: the kernel must read the same ones as torch


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    tokens=st.integers(1, 40),
    hq=st.integers(1, 6),
    hk=st.integers(1, 3),
    half=st.integers(1, 40),
    scale=st.sampled_from([0.5, 30.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    apart=st.booleans(),
)
def test_kernel_equals_the_torch_path_bit_for_bit(seed, tokens, hq, hk, half, scale, dtype, apart):
    g = torch.Generator().manual_seed(seed)
    d = 2 * half
    table = _table(g, 64, d)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    qkv, q, k = _qkv(g, tokens, hq, hk, d, dtype, scale)
    if apart:  # q and k not adjacent in memory: rotated one after the other
        k = k.clone()
    want_qkv, want_k = qkv.clone(), k.clone()
    wq = want_qkv[:, : hq * d].view(tokens, hq, d)
    wk = want_qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d) if not apart else want_k
    TorchOps().plain_rotary_embedding(positions, wq, wk, table)
    assert rotary_cpu_kernel.rotate(q, positions, table)
    assert rotary_cpu_kernel.rotate(k, positions, table)
    assert torch.equal(q, wq) and torch.equal(k, wk)
    assert torch.equal(qkv[:, (hq + hk) * d :], want_qkv[:, (hq + hk) * d :])  # v untouched


def test_the_ops_rotate_through_the_kernel_as_the_twin_does():
    g = torch.Generator().manual_seed(1)
    table = _table(g, 32, 64)
    positions = torch.tensor([0, 5, 31, 7])
    for dtype in (torch.float32, torch.bfloat16):
        qkv, q, k = _qkv(g, 4, 8, 2, 64, dtype, 2.0)
        want, _, _ = _qkv(torch.Generator().manual_seed(0), 4, 8, 2, 64, dtype, 1.0)
        want.copy_(qkv)
        TorchOps().plain_rotary_embedding(
            positions, want[:, :512].view(4, 8, 64), want[:, 512:640].view(4, 2, 64), table
        )
        TorchOps().rotary_embedding(positions, q, k, table)
        assert torch.equal(qkv, want)


def test_a_position_outside_the_table_is_refused_before_anything_is_written():
    g = torch.Generator().manual_seed(2)
    table = _table(g, 16, 8)
    _, q, _ = _qkv(g, 3, 2, 1, 8, torch.float32, 1.0)
    before = q.clone()
    for bad in (16, -1):
        with pytest.raises(KernelInputError, match="outside the cos/sin table"):
            rotary_cpu_kernel.rotate(q, torch.tensor([0, 3, bad]), table)
        assert torch.equal(q, before)


def test_other_operands_go_to_torch(monkeypatch):
    g = torch.Generator().manual_seed(3)
    table = _table(g, 16, 8)
    _, q, _ = _qkv(g, 3, 2, 1, 8, torch.float32, 1.0)
    positions = torch.tensor([0, 1, 2])
    assert not rotary_cpu_kernel.rotate(q.double(), positions, table)
    assert not rotary_cpu_kernel.rotate(q, positions.int(), table)  # int32 positions
    assert not rotary_cpu_kernel.rotate(q, positions, table.double())
    assert not rotary_cpu_kernel.rotate(q, positions, _table(g, 16, 6))  # rotary over part of the head
    assert not rotary_cpu_kernel.rotate(q, positions[:2], table)
    assert not rotary_cpu_kernel.rotate(q.transpose(0, 1), positions[:2], table)
    overlapping = torch.randn(40).as_strided((3, 2, 8), (4, 4, 1))  # heads that share elements
    assert not rotary_cpu_kernel.rotate(overlapping, positions, table)
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    assert not rotary_cpu_kernel.rotate(q, positions, table)
