"""Greedy choice on the CPU through gpu/kernels/argmax_cpu.c: `argmax(x)` equals `x.argmax(dim=-1)` on [N, V] fp32.

torch's CPU argmax reduces a row one element at a time: for a decode step of 24 rows over a 32,000-entry vocabulary
it took ~630 us, about a sixth of a LoRA-disabled bf16 step's sampling and several percent of the step. The kernel
takes a 16-lane max and then searches for its first occurrence, the same index torch gives (first of equal values;
a row with a NaN gives its first NaN). Built at first use (gpu/cpu_kernels.py); elsewhere torch's argmax runs.
"""

from __future__ import annotations

import ctypes

import torch

from loraledger.gpu import cpu_kernels

SOURCE = "argmax_cpu.c"


_ARGTYPES = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)


def _function():
    return cpu_kernels.function(SOURCE, "argmax_rows_f32", _ARGTYPES, ctypes.c_int)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value ([N] int64), through the kernel where it applies (a 2-D fp32 CPU
    tensor with contiguous rows), torch's argmax elsewhere."""
    fits = x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1
    fn = _function() if fits and x.shape[1] > 0 else None
    if fn is None:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out
