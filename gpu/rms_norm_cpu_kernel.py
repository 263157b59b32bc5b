"""Residual add + RMSNorm on the CPU through gpu/kernels/rms_norm_cpu.c: one pass per row instead of torch's seven or
eight whole-tensor ops (each a dispatch and a pass over memory; at a decode step's few rows, the fixed costs are most
of the time: ~8% of a LoRA-disabled step went to rms_norm).

Numerics: the residual add in the model dtype (as torch adds two bf16 tensors: in fp32, rounded once), the norm in
fp32, rounded to the model dtype once, as the torch twin (TorchOps.rms_norm's plain-torch path); the sum of squares
runs in vector partial sums, so fp32 results differ from torch's by the order of that sum.

Built at first use (gpu/cpu_kernels.py); where it cannot be, or for operands it does not take, the torch path runs.
"""

from __future__ import annotations

import ctypes

import torch

from loraledger.gpu import cpu_kernels

SOURCE = "rms_norm_cpu.c"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = (_I, _P, _I, _P, _I, _P, _I, _I, ctypes.c_float, _P, _P)


def _rows(t: torch.Tensor, like: torch.Tensor) -> bool:
    """t is a [rows, n] CPU tensor of like's dtype and shape with unit column stride."""
    return t.device.type == "cpu" and t.dtype == like.dtype and t.shape == like.shape and t.stride(1) == 1


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(out, r): out = RMSNorm(r) * weight, r = x + residual (x itself when there is none); None where the kernel
    does not apply (not built; not 2-D CPU rows of fp32 or bf16 with unit column stride; a weight of another dtype or
    length): the caller's torch path runs."""
    fits = (
        x.dim() == 2
        and x.device.type == "cpu"
        and x.dtype in cpu_kernels.DTYPE_CODES
        and x.stride(1) == 1
        and weight.dtype == x.dtype
        and weight.device.type == "cpu"
        and weight.shape == (x.shape[1],)
        and weight.is_contiguous()
        and (residual is None or _rows(residual, x))
    )
    fn = cpu_kernels.function(SOURCE, "rms_norm_rows", _ARGTYPES) if fits and x.shape[1] > 0 else None
    if fn is None:
        return None
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype)
    r = x if residual is None else torch.empty((rows, n), dtype=x.dtype)
    fn(
        cpu_kernels.DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0),
        None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
        weight.data_ptr(), rows, n, eps, out.data_ptr(), None if residual is None else r.data_ptr(),
    )  # fmt: skip
    return out, r
