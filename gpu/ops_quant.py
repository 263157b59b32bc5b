"""Weight-only quantized projections on CUDA (W4A16, W8A16): the kernels' launches, their torch twins, their checks.

`QuantLinearOps.quant_linear(x, weight)` is CudaOps' entry point for a projection whose weight is in the device
layout (loraledger/quantization/device_layout.py): y = x @ W.T in x's dtype. Up to GEMV_MAX_TOKENS rows (decode)
run the GEMV kernel, which reads the packed weight once per GEMV_TOKENS rows and never materialises W; more rows
(prefill) dequantize W to x's dtype with one kernel and multiply with torch (cuBLAS), where the arithmetic, not the
weight bytes, is the cost. The twins compute the same in plain torch from the fp32 weight the layout describes.
"""

from __future__ import annotations

import numpy as np
import torch

from loraledger.gpu import kernel_checks as checks
from loraledger.gpu import kernel_sources as ks
from loraledger.gpu.kernel_launcher import KernelLauncher
from loraledger.quantization.device_layout import DeviceQuantWeight, load_granule

GEMV_MAX_TOKENS = 8  # rows at or below which quant_linear runs the GEMV; above, dequantize + matmul
_GRID_STRIDE_BLOCKS = 65535


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def gemv_tokens(rows: int) -> int:
    """Tokens per GEMV pass for a call of `rows` rows: the smallest instantiation that covers them, at most 8."""
    return next((t for t in ks.QUANT_GEMV_TOKENS if t >= rows), ks.QUANT_GEMV_TOKENS[-1])


def check_quant_linear(x: torch.Tensor, weight: DeviceQuantWeight) -> None:
    op = "quant_linear"
    checks.require_tensor(op, "x", x)
    checks.require_dtype(op, "x", x, checks.FLOAT_DTYPES)
    if not isinstance(weight, DeviceQuantWeight):
        checks.fail(op, f"weight must be a DeviceQuantWeight, got {type(weight).__name__}")
    if x.dim() < 1 or x.shape[-1] != weight.in_features:
        checks.fail(
            op, f"x must have shape [..., {weight.in_features}] (the weight's in_features), got {tuple(x.shape)}"
        )
    n, k, bits = weight.out_features, weight.in_features, weight.bits
    if bits not in ks.QUANT_BITS:
        checks.fail(op, f"weight.bits must be one of {ks.QUANT_BITS}, got {bits}")
    if weight.group_size <= 0 or k % weight.group_size or weight.group_size % load_granule(bits):
        checks.fail(op, f"group_size {weight.group_size} must divide {k} and be a multiple of {load_granule(bits)}")
    groups = k // weight.group_size
    checks.require_dtype(op, "weight.qweight", weight.qweight, (torch.int32,))
    checks.require_shape(op, "weight.qweight", weight.qweight, "[N, K * bits / 32]", (n, k * bits // 32))
    checks.require_contiguous(op, "weight.qweight", weight.qweight)
    checks.require_dtype(op, "weight.scales", weight.scales, tuple(ks.QUANT_SCALE_TYPES))
    for name in ("scales", "zeros", "offsets"):
        t = getattr(weight, name)
        if t is None:
            continue
        checks.require_same_dtype(op, f"weight.{name}", t, "weight.scales", weight.scales)
        checks.require_shape(op, f"weight.{name}", t, "[N, K / group_size]", (n, groups))
        checks.require_contiguous(op, f"weight.{name}", t)
        checks.require_same_device(op, f"weight.{name}", t, "x", x)
    checks.require_same_device(op, "weight.qweight", weight.qweight, "x", x)
    if weight.perm is not None:
        checks.require_shape(op, "weight.perm", weight.perm, "[K]", (k,))
        checks.require_same_device(op, "weight.perm", weight.perm, "x", x)
    checks.require_int32_range(op, "N * K", n * k)


def _gathered(x: torch.Tensor, weight: DeviceQuantWeight) -> torch.Tensor:
    """x as [rows, K] contiguous, its columns in the weight's order."""
    x2 = x.reshape(-1, weight.in_features)
    if weight.perm is not None:
        x2 = x2.index_select(1, weight.perm)
    return x2.contiguous()


def quant_linear_twin(x: torch.Tensor, weight: DeviceQuantWeight) -> torch.Tensor:
    """The torch twin of quant_linear: the GEMV's math (fp32 products and sums of the fp32 weight) for decode rows;
    for prefill rows the weight rounded to x's dtype, as the dequantize kernel writes it, times x."""
    check_quant_linear(x, weight)
    x2 = _gathered(x, weight)
    w = weight.dequantize()
    if x2.shape[0] <= GEMV_MAX_TOKENS:
        y = x2.float() @ w.t()
    else:
        y = (x2.float() @ w.to(x.dtype).float().t()).to(x.dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.out_features)


def quant_dequantize_twin(weight: DeviceQuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The torch twin of the dequantize kernel: the fp32 weight rounded once to dtype."""
    return weight.dequantize().to(dtype)


class QuantLinearOps:
    """CudaOps' quantized-projection ops (a base class of CudaOps: it launches through CudaOps' launcher)."""

    _launcher: KernelLauncher
    device: torch.device

    def quant_linear(self, x: torch.Tensor, weight: DeviceQuantWeight) -> torch.Tensor:
        """y = x @ W.T for W in the device layout; x [..., K] fp32/bf16/fp16, y [..., N] in x's dtype."""
        check_quant_linear(x, weight)
        checks.require_device("quant_linear", "x", x, self.device)
        x2 = _gathered(x, weight)
        rows, n = x2.shape[0], weight.out_features
        if rows == 0 or n == 0:
            return x.new_zeros((*x.shape[:-1], n))
        if x2.data_ptr() % 16:
            x2 = x2.clone()  # the kernel loads 16-byte packs of x's rows
        if rows > GEMV_MAX_TOKENS:
            w = self.quant_dequantize(weight, x.dtype)
            y = x2 @ w.t()
        else:
            y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
            tokens = gemv_tokens(rows)
            per_block = ks.QUANT_GEMV_THREADS // 32 * ks.QUANT_GEMV_ROWS
            args = (
                _ptr(y),
                _ptr(x2),
                *self._weight_args(weight),
                np.int32(rows),
                np.int32(n),
                np.int32(weight.in_features),
                np.int32(weight.group_size),
            )
            targs = (ks.ELEMENT_TYPES[x.dtype], ks.QUANT_SCALE_TYPES[weight.scales.dtype], weight.bits, tokens)
            grid = (_cdiv(n, per_block), _cdiv(rows, tokens))
            self._launcher.launch(ks.QUANT_GEMV, targs, grid, ks.QUANT_GEMV_THREADS, args)
        return y.reshape(*x.shape[:-1], n)

    def quant_dequantize(self, weight: DeviceQuantWeight, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in dtype (fp32 arithmetic, rounded once), for a dense matmul."""
        check_quant_linear(torch.empty((0, weight.in_features), dtype=dtype, device=weight.qweight.device), weight)
        checks.require_device("quant_dequantize", "weight.qweight", weight.qweight, self.device)
        n, k = weight.out_features, weight.in_features
        out = torch.empty((n, k), dtype=dtype, device=weight.qweight.device)
        vecs = n * k // load_granule(weight.bits)
        if vecs:
            args = (
                _ptr(out),
                *self._weight_args(weight),
                np.int32(n),
                np.int32(k),
                np.int32(weight.group_size),
            )
            targs = (ks.QUANT_SCALE_TYPES[weight.scales.dtype], weight.bits, ks.ELEMENT_TYPES[dtype])
            grid = (min(_cdiv(vecs, ks.DEQUANT_THREADS), _GRID_STRIDE_BLOCKS),)
            self._launcher.launch(ks.QUANT_DEQUANTIZE, targs, grid, ks.DEQUANT_THREADS, args)
        return out

    @staticmethod
    def _weight_args(weight: DeviceQuantWeight) -> tuple[object, ...]:
        return (
            _ptr(weight.qweight),
            _ptr(weight.scales),
            _ptr(weight.zeros),
            _ptr(weight.offsets),
            np.float32(weight.zero),
        )
