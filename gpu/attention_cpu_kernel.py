"""Decode attention on the CPU through gpu/kernels/attention_cpu.c: the paged KV cache read in place.

Why a kernel: the torch path gathers every sequence's blocks into a [B, Hk, L, D] workspace (index_select), builds
a padded mask and runs SDPA over the padded keys, at every layer; for a decode step of 24 short sequences that is
most of the ~18% of a bf16 step attention takes, and little of it is arithmetic. The kernel walks each sequence's
block table and reads the keys and values where they are, each block front to back once for all query heads, with
the online softmax: no copies, no mask, no padding.

Where its time goes: a query head's scores for a vector's width of key rows at once, their per-row dot products
summed across lanes by one shuffle tree (not a chain of scalar adds per row and head); the weighted sum of V with
each output vector held in a register across a block's rows, two query heads of one KV head sharing every V load
(independent sums, so no add waits on the one before); the block's maximum and sum folded by halving. 24
sequences x 88 keys, GQA 8/2 x 64, on an AVX512-BF16 EPYC: 140 us a call in bf16 and 137 in fp32, against 299 and
242 with one scalar chain per dot product and a V sum that waited on itself. In a decode step the cache comes from
DRAM (the step streams the weights through the caches), so the next block is fetched while one is read
(bench/RESULTS.md, "CPU: the decode attention kernel, and short prefills through it"). Short prefills run here too:
each query row as a decode row over its causal prefix (TorchOps.prefill_attention).

Numerics: fp32 throughout (q widened and pre-scaled, the dot products, the running maximum and sum, the weighted
sum of V), rounded to the model dtype once at the end; exp is a vector polynomial (relative error ~1e-7). SDPA's
CPU kernel rounds the probabilities to bf16 before their product with V in a bf16 model, so in bf16 the kernel is
the closer of the two to fp32 attention; in fp32 the two differ by the order of their sums. Softcap (Gemma 2)
and sliding windows are the kernel's own as well.

Safety: the kernel first checks every block id it will read against the cache's block count and every length
against the table's width, and reads nothing when one is out of range (then the torch path runs, which reports
it as it always did). One thread, like the CPU LoRA kernel: a decode call is a fraction of a millisecond, and a
second thread's barrier on a shared machine waits until that thread is scheduled again.

Built at first use (gpu/cpu_kernels.py); where it cannot be, the torch path runs instead.
"""

from __future__ import annotations

import ctypes

import torch

from loraledger.gpu import cpu_kernels

SOURCE = "attention_cpu.c"
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ARGTYPES = (_I, _P, _I, _I, _P, _P, _I, _I, _I, _I, _P, _I, _I, _P, _I, _I, _F, _I, _F, _P, _P)


def _function():
    return cpu_kernels.function(SOURCE, "paged_decode_attention", _ARGTYPES)


def fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: one CPU dtype it knows for q and both caches, all on the CPU, q
    [B, Hq, D] with unit column stride, caches [N, block_size, Hk, D] contiguous, Hq >= 1 a multiple of Hk >= 1."""
    return (
        q.device.type == k_cache.device.type == v_cache.device.type == "cpu"
        and q.dtype in cpu_kernels.DTYPE_CODES
        and q.dtype == k_cache.dtype == v_cache.dtype
        and q.dim() == 3
        and k_cache.dim() == 4
        and k_cache.shape == v_cache.shape
        and q.shape[2] == k_cache.shape[3]
        and k_cache.shape[2] > 0
        and q.shape[1] > 0
        and q.shape[1] % k_cache.shape[2] == 0
        and q.stride(2) == 1
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def _index_tensor(t: torch.Tensor, dims: int) -> bool:
    """An int32 CPU tensor of `dims` dimensions: the kernel reads int32 ids and lengths (an int64 one could hold a
    value int32 would wrap: the torch path takes those)."""
    return t.device.type == "cpu" and t.dtype == torch.int32 and t.dim() == dims


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor | None:
    """out [B, Hq, D] (q's dtype) = paged decode attention, or None where the kernel does not apply (not built,
    operands it does not take (see fits), a block id or length out of range, a window or softcap that is not
    positive): the caller's torch path runs.

    block_tables [B, max_blocks] and seq_lens [B], int32 on the CPU. The kernel reads private copies of them: it
    checks them before it reads the cache, and runs without the GIL, so another thread must not change them in
    between."""
    usable = (
        fits(q, k_cache, v_cache)
        and _index_tensor(block_tables, 2)
        and _index_tensor(seq_lens, 1)
        and block_tables.shape[0] == seq_lens.shape[0] == q.shape[0] > 0
        and (sliding_window is None or sliding_window > 0)
        and (softcap is None or softcap > 0)
    )
    fn = _function() if usable else None
    if fn is None:
        return None
    tables = block_tables.clone(memory_format=torch.contiguous_format)
    lens = seq_lens.clone(memory_format=torch.contiguous_format)
    batch, hq, d = q.shape
    num_blocks, block_size, hk, _ = k_cache.shape
    out = torch.empty((batch, hq, d), dtype=q.dtype)
    scratch = torch.empty(hq * (2 * d + -(-block_size // 16) * 16 + 2), dtype=torch.float32)
    bad = fn(
        cpu_kernels.DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(),
        v_cache.data_ptr(), num_blocks, block_size, hk, d, tables.data_ptr(), tables.stride(0), tables.shape[1],
        lens.data_ptr(), batch, hq, scale, sliding_window or 0, softcap or 0.0, out.data_ptr(), scratch.data_ptr(),
    )  # fmt: skip
    return None if bad else out
