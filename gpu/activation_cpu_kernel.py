"""SiLU-and-multiply on the CPU through gpu/kernels/activation_cpu.c: silu(gate) * up of the fused gate/up output in
one pass, instead of torch's three (silu, the product, and the strided halves read twice), for steps of up to
MAX_ELEMENTS outputs (a decode step's rows: the operands stay in the caches and torch's fixed costs dominate; 24 x
1,376 fp32: 39 us against 67). A larger step (prefill) streams from memory, where the kernel's one thread loses to
torch's threads (1,152 x 1,376 fp32: 2.0 ms against 1.35, AMD EPYC with AVX2): torch runs those.

Numerics: silu in fp32 (x / (1 + e^-x), a vector exp with relative error ~1e-7); in bf16, silu rounded to bf16 before
the product and the product rounded again, as the torch twin (TorchOps.silu_and_mul's plain-torch path) computes it.

Built at first use (gpu/cpu_kernels.py); where it cannot be, or for operands it does not take, the torch path runs.
"""

from __future__ import annotations

import ctypes

import torch

from loraledger.gpu import cpu_kernels

SOURCE = "activation_cpu.c"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = (_I, _P, _I, _I, _I, _P)
MAX_ELEMENTS = 1 << 16  # outputs per call the kernel takes (see above)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(x[:, :i]) * x[:, i:] ([T, i], x's dtype), or None where the kernel does not apply (not built; not 2-D
    CPU rows of fp32 or bf16 with unit column stride and an even width; more than MAX_ELEMENTS outputs): the
    caller's torch path runs."""
    fits = (
        x.dim() == 2
        and x.device.type == "cpu"
        and x.dtype in cpu_kernels.DTYPE_CODES
        and x.stride(1) == 1
        and x.shape[1] % 2 == 0
        and x.shape[0] * (x.shape[1] // 2) <= MAX_ELEMENTS
    )
    fn = cpu_kernels.function(SOURCE, "silu_and_mul_rows", _ARGTYPES) if fits else None
    if fn is None:
        return None
    rows, i = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, i), dtype=x.dtype)
    fn(cpu_kernels.DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), rows, i, out.data_ptr())
    return out
