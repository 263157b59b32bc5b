"""The CPU argmax kernel (gpu/argmax_cpu_kernel.py) gives torch.argmax's index on generated rows: first of equal
values, the first NaN where a row has one, infinities, signed zeros, rows of any length and stride."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraledger.gpu import argmax_cpu_kernel, cpu_kernels
from tests.gpu.cpu_kernel_marks import CPU_KERNEL_TESTS

pytestmark = CPU_KERNEL_TESTS

SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0, 3.4e38, 1e-45]


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(1, 5),
    cols=st.integers(1, 70),
    pad=st.integers(0, 5),
    seed=st.integers(0, 2**16),
    specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIALS)), max_size=6),
    levels=st.sampled_from([None, 3]),
)
def test_kernel_equals_torch_argmax(rows, cols, pad, seed, specials, levels):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, cols + pad, generator=g)
    if levels:  # few distinct values: many ties, the first must win
        base = torch.randint(0, levels, (rows, cols + pad), generator=g).float()
    for pos, value in specials:
        base.view(-1)[pos % base.numel()] = value
    x = base[:, :cols]  # rows `cols + pad` apart
    assert argmax_cpu_kernel._function() is not None
    assert torch.equal(argmax_cpu_kernel.argmax(x), x.argmax(dim=-1))


def test_a_vocabulary_sized_batch():
    x = torch.randn(24, 32_000, generator=torch.Generator().manual_seed(1))
    x[3, 31_999] = x.max() + 1  # in the scalar tail past the last 16 lanes
    x[5, 7] = x[5, 9] = x[5].max() + 1  # a tie: the first
    assert torch.equal(argmax_cpu_kernel.argmax(x), x.argmax(dim=-1))


def test_other_inputs_go_to_torch(monkeypatch):
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    for x in (torch.randn(3, 40), torch.randn(3, 40).bfloat16(), torch.randn(40, 3).t(), torch.randn(2, 3, 4)):
        assert torch.equal(argmax_cpu_kernel.argmax(x), x.argmax(dim=-1))
