"""Rotary position embedding on the CPU through gpu/kernels/rotary_cpu.c: q and k rotated in place in one pass,
instead of torch's ten whole-tensor ops per call (two fp32 copies of the halves, four products, two sums, two
copies back; at a decode step's few rows their fixed costs are the time: ~110 us a call, 35 ms of a 740 ms
LoRA-disabled bf16 batch of the bench model, against the kernel's few microseconds).

Numerics: fp32, each product rounded before its sum, rounded once to the model dtype: the torch twin's result bit for
bit (TorchOps.rotary_embedding's plain-torch path, and transformers' in fp32).

Built at first use (gpu/cpu_kernels.py); where it cannot be, or for operands it does not take, the torch path runs.
"""

from __future__ import annotations

import ctypes

import torch

from loraledger.errors import KernelInputError
from loraledger.gpu import cpu_kernels

SOURCE = "rotary_cpu.c"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = (_I, _P, _I, _I, _I, _I, _I, _P, _P, _I)


def rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> bool:
    """Rotate x [T, H, D] in place by positions [T] with cos_sin [P, D] (cos in the first D/2 columns, sin in the
    last); False where the kernel does not apply (not built; x not CPU fp32 or bf16 with unit element stride and D
    equal to cos_sin's width; positions not int64 CPU [T] contiguous; cos_sin not fp32 CPU contiguous): nothing is
    written and the caller's torch path runs. A position outside cos_sin's rows raises KernelInputError, before
    anything is written."""
    fits = (
        x.dim() == 3
        and x.is_cpu
        and x.dtype in cpu_kernels.DTYPE_CODES
        and x.stride(2) == 1
        and x.stride(1) >= x.shape[2]  # heads and tokens that do not overlap: each element rotated once
        and x.stride(0) >= x.shape[1] * x.stride(1)
        and cos_sin.dim() == 2
        and cos_sin.is_cpu
        and cos_sin.dtype == torch.float32
        and cos_sin.is_contiguous()
        and cos_sin.shape[1] % 2 == 0
        and x.shape[2] == cos_sin.shape[1]
        and positions.is_cpu
        and positions.dtype == torch.int64
        and positions.shape == (x.shape[0],)
        and positions.is_contiguous()
    )
    fn = cpu_kernels.function(SOURCE, "rotary_rows", _ARGTYPES) if fits else None
    if fn is None:
        return False
    tokens, heads, width = x.shape
    status = fn(
        cpu_kernels.DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), x.stride(1), tokens, heads, width // 2,
        positions.data_ptr(), cos_sin.data_ptr(), cos_sin.shape[0],
    )  # fmt: skip
    if status != 0:
        raise KernelInputError(
            f"a rotary position is outside the cos/sin table's {cos_sin.shape[0]} positions: positions must be "
            f"0..{cos_sin.shape[0] - 1} (a sequence longer than max_model_len?)"
        )
    return True
