"""CudaOps: the device ops as CuPy RawKernels (gpu/kernels/*.cu) launched on torch's current CUDA stream.

Tensors reach the kernels without copies: each launch passes `tensor.data_ptr()` and sizes as
typed scalars, after the pure checks of kernel_checks.py have vouched for shapes, strides,
dtypes and devices. CuPy is imported only when a CudaOps is built.

The ops live by concept: the small fused ops here, KV cache and attention in ops_cuda_attention.py,
LoRA in ops_cuda_lora.py, weight-only quantized projections in ops_quant.py; CudaOps inherits them.
"""

from __future__ import annotations

import numpy as np
import torch

from loraledger.errors import ConfigError, DeviceError
from loraledger.gpu import kernel_checks as checks
from loraledger.gpu import kernel_sources as ks
from loraledger.gpu.backend import require_cuda
from loraledger.gpu.kernel_args import GRID_STRIDE_BLOCKS, cdiv, i32, i64, ptr
from loraledger.gpu.kernel_launcher import CupyLauncher, KernelLauncher
from loraledger.gpu.ops import StepMemo
from loraledger.gpu.ops_cuda_attention import CudaAttentionOps, prefill_sizes, sdpa_prefill_attention
from loraledger.gpu.ops_cuda_lora import LORA_KERNELS, CudaLoraOps, lora_segments, lora_tiles
from loraledger.gpu.ops_quant import QuantLinearOps

__all__ = ["LORA_KERNELS", "CudaOps", "lora_segments", "lora_tiles", "prefill_sizes", "sdpa_prefill_attention"]


class CudaOps(QuantLinearOps, CudaAttentionOps, CudaLoraOps):
    name = "cuda"

    def __init__(
        self, device: torch.device | str = "cuda", *, lora_kernel: str = "auto", launcher: KernelLauncher | None = None
    ) -> None:
        """lora_kernel: "auto" picks per call: SGMV for long same-adapter runs, else the fused one-launch
        BGMV on GPUs with thread block clusters (compute capability 9.0), else BGMV shrink then expand;
        "bgmv" / "sgmv" / "fused" force one (tests, benchmarks).

        launcher: None runs the kernels with CuPy on the CUDA device; anything else is used as given
        (the tests pass a CPU emulation of the kernels, with CPU tensors).
        """
        if lora_kernel not in LORA_KERNELS:
            raise ConfigError(f"lora_kernel must be one of {LORA_KERNELS}, got {lora_kernel!r}")
        dev = torch.device(device)
        if launcher is None:
            require_cuda()
            if dev.type != "cuda":
                raise DeviceError(f"CudaOps needs a CUDA device, got {str(dev)!r}; use TorchOps for the CPU")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            launcher = CupyLauncher(dev)
        self.device = dev
        self._lora_kernel = lora_kernel
        self._launcher = launcher
        self._slice_offsets: dict[tuple[int, ...], torch.Tensor] = {}
        self._step_memo = StepMemo()  # eager steps only: graph steps never reach prefill_attention

    @property
    def compute_capability(self) -> tuple[int, int]:
        """The device's (major, minor) compute capability, as the kernels are built for it."""
        return self._launcher.compute_capability

    # ---- small fused ops ----

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        checks.check_rms_norm(x, weight, residual)
        checks.require_device("rms_norm", "x", x, self.device)
        tokens, hidden = x.shape
        out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
        r_out = None if residual is None else torch.empty_like(out)
        if tokens and hidden:
            vec = 16 // x.element_size()
            threads = min(1024, max(32, cdiv(cdiv(hidden, vec), 32) * 32))
            args = (
                ptr(out),
                ptr(r_out),
                ptr(x),
                i64(x.stride(0)),
                ptr(residual),
                i64(0 if residual is None else residual.stride(0)),
                ptr(weight),
                i32(tokens),
                i32(hidden),
                np.float32(eps),
            )
            grid = (min(tokens, GRID_STRIDE_BLOCKS),)
            self._launcher.launch(ks.RMS_NORM, (ks.ELEMENT_TYPES[x.dtype],), grid, threads, args)
        return out, (x if r_out is None else r_out)

    def rotary_embedding(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> None:
        checks.check_rotary_embedding(positions, q, k, cos_sin_cache)
        checks.require_device("rotary_embedding", "q", q, self.device)
        tokens, hq, d = q.shape
        hk = k.shape[1]
        if tokens == 0 or d == 0:
            return
        threads = min(512, cdiv((hq + hk) * (d // 2), 32) * 32)
        args = (
            ptr(q),
            i64(q.stride(0)),
            ptr(k),
            i64(k.stride(0)),
            ptr(positions),
            ptr(cos_sin_cache),
            i32(tokens),
            i32(hq),
            i32(hk),
            i32(d),
            i64(cos_sin_cache.shape[0]),
        )
        targs = (ks.ELEMENT_TYPES[q.dtype], ks.INDEX_TYPES[positions.dtype])
        self._launcher.launch(ks.ROTARY_EMBEDDING, targs, (min(tokens, GRID_STRIDE_BLOCKS),), threads, args)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        checks.check_silu_and_mul(x)
        checks.require_device("silu_and_mul", "x", x, self.device)
        tokens, inter = x.shape[0], x.shape[1] // 2
        out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
        if tokens and inter:
            threads = 256
            blocks = min(cdiv(tokens * inter, threads), GRID_STRIDE_BLOCKS)
            args = (ptr(out), ptr(x), i64(x.stride(0)), i32(tokens), i32(inter))
            self._launcher.launch(ks.SILU_AND_MUL, (ks.ELEMENT_TYPES[x.dtype],), (blocks,), threads, args)
        return out
