"""The CPU LoRA kernel (gpu/kernels/lora_cpu.c): a step's multi-LoRA delta in one call per fused module.

Why a kernel: at decode each adapter has a few tokens, and in plain torch one module's delta is a gather, a
grouped `bmm` for A, one for B, a compaction and an add, each with a fixed cost (a bf16 `bmm` of a few rows
spends ~20 us setting up oneDNN before it multiplies anything) and each writing an intermediate tensor; a step of
the bench model makes 32 such calls. The kernel reads each active slot's A and B rows once for up to 4 tokens,
keeps h in registers and scratch, and adds the delta into y in place: ~3x less time per step than the torch path
for the same arithmetic (bench/RESULTS.md, "Where a mixed bf16 step goes"). Prefill runs of one adapter go
through it as groups too, up to a length that depends on the CPU (LoraCpuKernel.run_limit): torch's GEMMs of a few
dozen rows at rank 16 spend more time per product than they multiply.

Layouts: A as the slots hold it ([S, n*R, in] per layer); B rank-major, [S, R, out_total] per layer (row r of every
slice side by side, no zero blocks), which LoraSlots holds for these ops (`layout="rank_major"`) and hands out
as the transposed view [S, out_total, R], so every other reader sees the usual B.

Numerics: fp32 accumulation; for bf16, h and the delta rounded to bf16 and y = bf16(y + delta), as the torch twin
(TorchLoraOps' grouped path) and PEFT's bf16 layers do. On a CPU with AVX512-BF16 the bf16 products are vdpbf16ps,
as in oneDNN's bf16 GEMMs (pairs of bf16 products summed in fp32; subnormal inputs count as zero); elsewhere
16-lane fp32 vectors. The fp32 sums run in another order than oneDNN's or MKL's: tests compare the kernel with the
torch path within rounding, and the engine's greedy ids with transformers + PEFT.

One thread: a call is tens of microseconds, and on a shared machine a second thread's barrier waits until that
thread is scheduled again (the torch path's grouped products run on one thread for the same reason).

Built at first use (gpu/cpu_kernels.py); where it cannot be, the torch path runs instead.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from loraledger.gpu import cpu_features, cpu_kernels

SOURCE = "lora_cpu.c"
TOKENS_PER_PASS = 4  # MT in the source: scratch rows per pass
_FUNCTIONS = {torch.float32: "lora_grouped_f32", torch.bfloat16: "lora_grouped_bf16"}
# the longest prefill runs the kernel takes (LoraCpuKernel.run_limit)
_RUN_MAX_8_LANES = 96
_RUN_MAX_16_LANES = 256
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _I, _I, _P, _I, _P, _I, _P, _I, _I, _I, _P, _I, _P, _I, _P, _P, _P, _P]


class LoraCpuKernel:
    """The loaded library: `grouped(...)` runs one fused module's delta for a step's groups of tokens."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._functions = {}
        for dtype, name in _FUNCTIONS.items():
            fn = getattr(library, name)
            fn.argtypes = _ARGTYPES
            fn.restype = ctypes.c_int
            self._functions[dtype] = fn
        self.lanes = int(library.lora_vector_lanes())  # of its fp32 vectors: 16 with AVX-512, else 8
        self.bf16_dot = bool(library.lora_bf16_dot())  # its bf16 products are vdpbf16ps (AVX512-BF16)

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._functions

    def run_limit(self, dtype: torch.dtype, native_bf16: bool) -> int | None:
        """The longest prefill run (same-adapter tokens) this build takes instead of torch's GEMMs: None for every
        run, 0 for none. The kernel's time per token is flat; torch's falls with the run's length as its per-GEMM
        cost is spread, and where the two cross depends on the vectors (measured, bench/RESULTS.md: on an AVX2
        EPYC kernel / torch 1.05x at 96-token runs and 0.76x at 192; on an AVX-512 EPYC it is still ahead at 144-192
        in fp32 and in bf16 against oneDNN, behind at 288 in fp32 and at 1,152 in bf16).
        - fp32: 96 tokens with 8 lanes, 256 with 16;
        - bf16 that the CPU emulates: every run (torch would multiply fp32 copies of every run's rows and stacks);
        - bf16 with native products: 256 where this build's are vdpbf16ps and the CPU has no AMX (oneDNN's AMX
          tiles multiply several times faster, not measured here: runs stay with oneDNN), else none."""
        if dtype == torch.float32:
            return _RUN_MAX_16_LANES if self.lanes >= 16 else _RUN_MAX_8_LANES
        if dtype != torch.bfloat16:
            return 0
        if not native_bf16:
            return None
        return _RUN_MAX_16_LANES if self.bf16_dot and not cpu_features.amx_bf16() else 0

    def bind(self, a: torch.Tensor, b: torch.Tensor, slice_offsets: torch.Tensor) -> BoundStacks:
        """One fused module's stacks as the kernel reads them, for run(): their pointers and sizes taken once.

        The caller checks what the kernel reads without bounds (TorchLoraOps._stack_kernel and _kernel_for): a
        [S, n*R, in] contiguous; b the rank-major view [S, out, R] (strides (R*out, 1, out)); one CPU dtype the
        kernel has for both; int64 slice_offsets [n+1], ordered, within out. The stacks must outlive the binding
        (LoraSlots writes them in place and never replaces them)."""
        rank = b.shape[2]
        return BoundStacks(
            kernel=self,
            function=self._functions[a.dtype],
            dtype=a.dtype,
            slots=a.shape[0],
            in_features=a.shape[2],
            out_total=b.shape[1],
            scratch_floats=scratch_floats(a.shape[2], a.shape[1]),
            stacks=(a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0)),
            slices=(slice_offsets.shape[0] - 1, slice_offsets.data_ptr(), rank),
            held=(a, b, slice_offsets),
        )

    @staticmethod
    def run(stacks: BoundStacks, x: torch.Tensor, y: torch.Tensor, plan: tuple, scratch: torch.Tensor) -> None:
        """y[t] += (x[t] a[s]^T) b[s]^T for each token t of each group's slot s (see the source for the layouts).

        x, y [T, in] / [T, out] in the stacks' dtype with unit column stride (checked by TorchLoraOps._kernel_for);
        plan: (slot_ranks, G, group_slot, group_start, tokens) as pointers (group_plan); fp32 scratch of
        stacks.scratch_floats elements. One thread (see the source for why)."""
        stacks.function(
            x.data_ptr(),
            x.stride(0),
            stacks.in_features,
            *stacks.stacks,
            y.data_ptr(),
            y.stride(0),
            stacks.out_total,
            *stacks.slices,
            *plan,
            scratch.data_ptr(),
        )


@dataclass(frozen=True, slots=True)
class BoundStacks:
    """A fused module's stacks bound to the kernel (LoraCpuKernel.bind): what run() passes for them, and the sizes
    the caller checks x and y against."""

    kernel: LoraCpuKernel
    function: Callable[..., int]  # the dtype's C function
    dtype: torch.dtype
    slots: int
    in_features: int
    out_total: int
    scratch_floats: int
    stacks: tuple[int, int, int, int]  # A's pointer and slot stride, B's pointer and slot stride
    slices: tuple[int, int, int]  # slices, their offsets' pointer, rank
    held: tuple  # the tensors the pointers are of, kept alive with the binding


def group_plan(
    slot_ranks: torch.Tensor | None, group_slot: torch.Tensor, group_start: torch.Tensor, tokens: torch.Tensor
) -> tuple:
    """A step's group table as run() passes it: int32 slot_ranks [S] or None (rows past a slot's rank are zero,
    skipped), int64 group_slot [G], group_start [G+1] and tokens, as pointers; the tensors must outlive the plan
    (the step's LoraMeta holds them)."""
    return (
        None if slot_ranks is None else slot_ranks.data_ptr(),
        group_slot.shape[0],
        group_slot.data_ptr(),
        group_start.data_ptr(),
        tokens.data_ptr(),
    )


def scratch_floats(in_features: int, n_rank: int) -> int:
    """fp32 elements of scratch one call needs: the pass's x rows in fp32 and its h."""
    return TOKENS_PER_PASS * (in_features + n_rank)


@functools.cache
def load() -> LoraCpuKernel | None:
    """The kernel, built on first use (cached on disk); None where it cannot be (the torch path runs instead)."""
    built = cpu_kernels.library(SOURCE)
    return None if built is None else LoraCpuKernel(*built)
