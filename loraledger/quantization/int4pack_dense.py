"""Int4packDense: torch's CPU int4pack bytes dequantized back into a bf16 weight, for steps with many rows.

torch's `_weight_int4pack_mm_for_cpu` is a row-by-row kernel: its time grows with the rows, while a dense bf16 GEMM's
barely does. For a step of many rows (prefill) it pays to dequantize the packed weight into a reused scratch and run
one dense product; the resident weight stays the packed one (0.27x bf16). The packed layout is torch's
(`_convert_weight_to_int4pack_for_cpu`), which depends on the CPU capability torch dispatched to: with AVX512 blocks
of 64 output rows, byte [k, j] holding rows j (low nibble) and j + 32 (high) ("split64"); with AVX2 blocks of 32
rows, byte [k, j] holding rows j and j + 16 ("split32"); elsewhere blocks of 32 rows, byte [k, j] holding rows 2j and
2j + 1 ("pairs32"); a trailing block of 16 rows is always in pairs. The layout is read once, from torch itself, by
packing a probe; when none matches it is None and the kernel runs every step.

The product equals F.linear(x, W) for the bf16 weight W = (q - 8) * scale + bias (fp32 arithmetic, one rounding),
which is what the int4 kernel computes with (`dense_weight`).
"""

from __future__ import annotations

import functools
import threading

import torch

BLOCK = 64  # column chunks are whole blocks of either layout
SCRATCH_BYTES = 32 << 20  # the bf16 scratch per thread: a bigger weight is dequantized in column chunks


def _unpack_into(packed: torch.Tensor, n: int, k: int, out: torch.Tensor, layout: str) -> None:
    """q^T [k, n] (values 0..15, any float dtype) from the int4pack bytes of n rows (n a multiple of 16)."""
    block = 64 if layout == "split64" else 32
    full = n // block * block
    p = packed.reshape(-1)
    if full:
        pf = p[: full * k // 2].view(full // block, k, block // 2)
        if layout.startswith("split"):
            wide = out[:, :full].view(k, full // block, 2, block // 2)
            wide[:, :, 0, :].copy_((pf & 15).permute(1, 0, 2))
            wide[:, :, 1, :].copy_((pf >> 4).permute(1, 0, 2))
        else:
            wide = out[:, :full].view(k, full // block, block // 2, 2)
            wide[..., 0].copy_((pf & 15).permute(1, 0, 2))
            wide[..., 1].copy_((pf >> 4).permute(1, 0, 2))
    if n > full:
        tail = p[full * k // 2 :].view(k, (n - full) // 2)
        pairs = out[:, full:].view(k, (n - full) // 2, 2)
        pairs[..., 0].copy_(tail & 15)
        pairs[..., 1].copy_(tail >> 4)


@functools.cache
def layout() -> str | None:
    """Which int4pack layout this process's torch writes ("split64", "split32", "pairs32"), or None if none."""
    q = torch.randint(0, 16, (176, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    for name in ("split64", "split32", "pairs32"):
        out = torch.empty(64, 176, dtype=torch.int32)
        _unpack_into(packed, 176, 64, out, name)
        if torch.equal(out.t(), q):
            return name
    return None


class _Scratch(threading.local):
    buffer: torch.Tensor | None = None


_scratch = _Scratch()


def _scratch_view(k: int, n: int) -> torch.Tensor:
    if _scratch.buffer is None or _scratch.buffer.numel() < k * n:
        _scratch.buffer = torch.empty(k * n, dtype=torch.bfloat16)
    return _scratch.buffer[: k * n].view(k, n)


def _dequantize_into(packed, scales_and_zeros, group: int, n0: int, n1: int, k: int, out: torch.Tensor) -> None:
    """out [k, n1 - n0] bf16 = W[n0:n1].T, dequantized as the int4 kernel does: (q - 8) * scale + bias."""
    _unpack_into(packed.reshape(-1)[n0 * k // 2 : n1 * k // 2], n1 - n0, k, out, layout())
    sz = scales_and_zeros[:, n0:n1].float()  # [groups, n, 2]: one pair per group of `group` columns
    scale = sz[..., 0].unsqueeze(1)
    offset = (sz[..., 1] - 8.0 * sz[..., 0]).unsqueeze(1)  # exact: 8 * a bf16 scale, and two bf16 values' difference
    grouped = out.view(k // group, group, n1 - n0)
    torch.addcmul(offset, grouped, scale, out=grouped)  # fp32 arithmetic, one rounding to bf16


def dense_weight(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int, n: int, k: int) -> torch.Tensor:
    """The bf16 weight [n, k] the int4 kernel computes with (the twin of `linear`, and the layer's reference)."""
    out = torch.empty(k, n, dtype=torch.bfloat16)
    _dequantize_into(packed, scales_and_zeros, group, 0, n, k, out)
    return out.t().contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int, n: int) -> torch.Tensor:
    """x [m, k] bf16 @ W.T through a scratch bf16 weight, in column chunks of at most SCRATCH_BYTES."""
    k = x.shape[1]
    chunk = max(BLOCK, SCRATCH_BYTES // (2 * k) // BLOCK * BLOCK)
    if n <= chunk:
        w_t = _scratch_view(k, n)
        _dequantize_into(packed, scales_and_zeros, group, 0, n, k, w_t)
        return torch.mm(x, w_t)
    parts = []
    for n0 in range(0, n, chunk):  # a few chunks of a large projection, not a loop over rows or requests
        n1 = min(n, n0 + chunk)
        w_t = _scratch_view(k, n1 - n0)
        _dequantize_into(packed, scales_and_zeros, group, n0, n1, k, w_t)
        parts.append(torch.mm(x, w_t))
    return torch.cat(parts, dim=1)


def read_rows(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int, n: int, k: int, index: torch.Tensor):
    """fp32 rows W[index] [len(index), k] of the packed weight, without touching the others (an embedding lookup)."""
    block = 64 if layout() == "split64" else 32
    full = n // block * block
    r = index.to(torch.int64)
    in_block = r < full
    j = torch.where(in_block, r % block, r - full)
    if layout().startswith("split"):  # byte [k, j % half], the high nibble for j >= half
        half = block // 2
        base_full, shift_full, stride_full = (r // block) * (block * k // 2) + j % half, 4 * (j // half), half
    else:  # byte [k, j // 2], the high nibble for odd j
        base_full, shift_full, stride_full = (r // block) * (block * k // 2) + j // 2, 4 * (j % 2), block // 2
    tail = max(n - full, 2)
    base = torch.where(in_block, base_full, full * k // 2 + j // 2)
    shift = torch.where(in_block, shift_full, 4 * (j % 2))
    stride = torch.where(in_block, torch.full_like(r, stride_full), torch.full_like(r, tail // 2))
    cols = torch.arange(k, dtype=torch.int64)
    raw = packed.reshape(-1)[base[:, None] + cols[None, :] * stride[:, None]].to(torch.int32)
    q = ((raw >> shift[:, None].to(torch.int32)) & 15).to(torch.float32)
    sz = scales_and_zeros[:, r].float()  # [groups, rows, 2]
    scale, bias = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]  # [rows, groups, 1]
    return ((q.view(len(r), -1, group) - 8.0) * scale + bias).view(len(r), k)
