"""Input checks of the CUDA kernel wrappers: shapes, strides, dtypes, devices and contiguity, as pure functions.

A kernel trusts its pointers, so every wrapper in CudaOps calls one of the `check_*` functions
below before it launches. They need no GPU (tests run them on CPU tensors) and raise
KernelInputError naming the op, the argument, what was expected and what was given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch

from loraledger.errors import KernelInputError
from loraledger.gpu.kernel_sources import ATTENTION_MAX_HEAD_DIM, ELEMENT_TYPES, INDEX_TYPES

FLOAT_DTYPES = tuple(ELEMENT_TYPES)
INDEX_DTYPES = tuple(INDEX_TYPES)
# the kernels index with 32-bit ints within a row and per token
_MAX_INT32 = 2**31 - 1


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def fail(op: str, message: str) -> NoReturn:
    raise KernelInputError(f"{op}: {message}")


def require_tensor(op: str, name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")


def require_dtype(op: str, name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        fail(op, f"{name} must be {_dtype_names(allowed)}, got {_dtype_names((t.dtype,))}")


def require_same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        fail(op, f"{name} must have {ref_name}'s dtype {_dtype_names((ref.dtype,))}, got {_dtype_names((t.dtype,))}")


def require_shape(op: str, name: str, t: torch.Tensor, layout: str, expected: Sequence[int | None]) -> None:
    """expected: one entry per dimension, None where any size is fine; layout names them, e.g. "[T, H]"."""
    shape = tuple(t.shape)
    if len(shape) != len(expected) or any(e is not None and s != e for s, e in zip(shape, expected)):
        want = ", ".join("*" if e is None else str(e) for e in expected)
        fail(op, f"{name} must have shape {layout} = ({want}), got {shape}")


def require_same_device(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        fail(op, f"{name} must be on {ref_name}'s device {ref.device}, got {t.device}")


def require_device(op: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        fail(op, f"{name} must be on {device} (the backend's device), got {t.device}; move it with .to('{device}')")


def require_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        fail(op, f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}; pass .contiguous()")


def require_rows(op: str, name: str, t: torch.Tensor) -> None:
    """Dense rows: every dimension but the first is contiguous; the first may have any stride >= a row.

    Row-strided views such as q/k/v split from a fused qkv output pass without a copy.
    """
    expected = 1
    for dim in range(t.dim() - 1, 0, -1):
        if t.shape[dim] != 1 and t.stride(dim) != expected:
            fail(
                op,
                f"{name} must have contiguous rows (all dimensions after the first dense), "
                f"got strides {t.stride()} for shape {tuple(t.shape)}; pass .contiguous()",
            )
        expected *= t.shape[dim]
    if t.dim() >= 1 and t.shape[0] > 1 and t.stride(0) < expected:
        fail(op, f"{name}'s rows must not overlap: stride(0) must be >= {expected}, got {t.stride(0)}")


def require_int32_range(op: str, name: str, value: int) -> None:
    if value > _MAX_INT32:
        fail(op, f"{name} ({value}) is above 2**31 - 1, which the kernels' 32-bit indexing cannot address")


# ---- one function per op ----


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    op = "rms_norm"
    require_tensor(op, "x", x)
    require_dtype(op, "x", x, FLOAT_DTYPES)
    require_shape(op, "x", x, "[T, H]", (None, None))
    require_rows(op, "x", x)
    hidden = x.shape[1]
    require_tensor(op, "weight", weight)
    require_same_dtype(op, "weight", weight, "x", x)
    require_shape(op, "weight", weight, "[H]", (hidden,))
    require_contiguous(op, "weight", weight)
    require_same_device(op, "weight", weight, "x", x)
    if residual is not None:
        require_tensor(op, "residual", residual)
        require_same_dtype(op, "residual", residual, "x", x)
        require_shape(op, "residual", residual, "[T, H]", tuple(x.shape))
        require_rows(op, "residual", residual)
        require_same_device(op, "residual", residual, "x", x)


def check_rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    op = "rotary_embedding"
    require_tensor(op, "q", q)
    require_dtype(op, "q", q, FLOAT_DTYPES)
    require_shape(op, "q", q, "[T, Hq, D]", (None, None, None))
    require_rows(op, "q", q)
    tokens, _, head_dim = q.shape
    if head_dim % 2:
        fail(op, f"head_dim (q.shape[2]) must be even to rotate pairs of halves, got {head_dim}")
    require_tensor(op, "k", k)
    require_same_dtype(op, "k", k, "q", q)
    require_shape(op, "k", k, "[T, Hk, D]", (tokens, None, head_dim))
    require_rows(op, "k", k)
    require_same_device(op, "k", k, "q", q)
    require_tensor(op, "positions", positions)
    require_dtype(op, "positions", positions, INDEX_DTYPES)
    require_shape(op, "positions", positions, "[T]", (tokens,))
    require_contiguous(op, "positions", positions)
    require_same_device(op, "positions", positions, "q", q)
    require_tensor(op, "cos_sin_cache", cos_sin_cache)
    require_dtype(op, "cos_sin_cache", cos_sin_cache, (torch.float32,))
    require_shape(op, "cos_sin_cache", cos_sin_cache, "[max_pos, D]", (None, head_dim))
    require_contiguous(op, "cos_sin_cache", cos_sin_cache)
    require_same_device(op, "cos_sin_cache", cos_sin_cache, "q", q)


def check_silu_and_mul(x: torch.Tensor) -> None:
    op = "silu_and_mul"
    require_tensor(op, "x", x)
    require_dtype(op, "x", x, FLOAT_DTYPES)
    require_shape(op, "x", x, "[T, 2I]", (None, None))
    require_rows(op, "x", x)
    if x.shape[1] % 2:
        fail(op, f"x.shape[1] must be even (gate and up halves), got {x.shape[1]}")


def _check_caches(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor, *, power_of_two_blocks: bool) -> None:
    require_tensor(op, "k_cache", k_cache)
    require_dtype(op, "k_cache", k_cache, FLOAT_DTYPES)
    require_shape(op, "k_cache", k_cache, "[num_blocks, block_size, Hk, D]", (None, None, None, None))
    require_contiguous(op, "k_cache", k_cache)
    require_tensor(op, "v_cache", v_cache)
    require_same_dtype(op, "v_cache", v_cache, "k_cache", k_cache)
    require_shape(op, "v_cache", v_cache, "[num_blocks, block_size, Hk, D]", tuple(k_cache.shape))
    require_contiguous(op, "v_cache", v_cache)
    require_same_device(op, "v_cache", v_cache, "k_cache", k_cache)
    block_size = k_cache.shape[1]
    if power_of_two_blocks and (block_size < 1 or block_size & (block_size - 1)):
        fail(op, f"block_size (k_cache.shape[1]) must be a power of two, got {block_size}")
    require_int32_range(op, "num_kv_heads * head_dim", k_cache.shape[2] * k_cache.shape[3])


def check_write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    op = "write_kv"
    _check_caches(op, k_cache, v_cache, power_of_two_blocks=False)
    _, _, kv_heads, head_dim = k_cache.shape
    require_tensor(op, "key", key)
    require_same_dtype(op, "key", key, "k_cache", k_cache)
    require_shape(op, "key", key, "[T, Hk, D]", (None, kv_heads, head_dim))
    require_rows(op, "key", key)
    require_same_device(op, "key", key, "k_cache", k_cache)
    tokens = key.shape[0]
    require_tensor(op, "value", value)
    require_same_dtype(op, "value", value, "k_cache", k_cache)
    require_shape(op, "value", value, "[T, Hk, D]", (tokens, kv_heads, head_dim))
    require_rows(op, "value", value)
    require_same_device(op, "value", value, "k_cache", k_cache)
    require_tensor(op, "slot_mapping", slot_mapping)
    require_dtype(op, "slot_mapping", slot_mapping, INDEX_DTYPES)
    require_shape(op, "slot_mapping", slot_mapping, "[T]", (tokens,))
    require_contiguous(op, "slot_mapping", slot_mapping)
    require_same_device(op, "slot_mapping", slot_mapping, "k_cache", k_cache)


def _check_window(op: str, sliding_window: int | None) -> None:
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        fail(op, f"sliding_window must be None or an int >= 1, got {sliding_window!r}")


def check_paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
) -> None:
    op = "paged_attention_decode"
    _check_caches(op, k_cache, v_cache, power_of_two_blocks=True)
    _, _, kv_heads, head_dim = k_cache.shape
    if head_dim > ATTENTION_MAX_HEAD_DIM:
        fail(op, f"head_dim must be <= {ATTENTION_MAX_HEAD_DIM}, got {head_dim}")
    require_tensor(op, "q", q)
    require_same_dtype(op, "q", q, "k_cache", k_cache)
    require_shape(op, "q", q, "[B, Hq, D]", (None, None, head_dim))
    require_rows(op, "q", q)
    require_same_device(op, "q", q, "k_cache", k_cache)
    batch, heads = q.shape[0], q.shape[1]
    if heads % kv_heads:
        fail(op, f"the query heads ({heads}) must be a multiple of the KV heads ({kv_heads}) for GQA")
    require_tensor(op, "block_tables", block_tables)
    require_dtype(op, "block_tables", block_tables, (torch.int32,))
    require_shape(op, "block_tables", block_tables, "[B, max_blocks]", (batch, None))
    require_rows(op, "block_tables", block_tables)
    require_same_device(op, "block_tables", block_tables, "k_cache", k_cache)
    require_tensor(op, "seq_lens", seq_lens)
    require_dtype(op, "seq_lens", seq_lens, (torch.int32,))
    require_shape(op, "seq_lens", seq_lens, "[B]", (batch,))
    require_contiguous(op, "seq_lens", seq_lens)
    require_same_device(op, "seq_lens", seq_lens, "k_cache", k_cache)
    _check_window(op, sliding_window)


def check_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    sliding_window: int | None,
) -> None:
    op = "prefill_attention"
    _check_caches(op, k_cache, v_cache, power_of_two_blocks=False)
    _, _, kv_heads, head_dim = k_cache.shape
    require_tensor(op, "q", q)
    require_same_dtype(op, "q", q, "k_cache", k_cache)
    require_shape(op, "q", q, "[Tq, Hq, D]", (None, None, head_dim))
    require_same_device(op, "q", q, "k_cache", k_cache)
    if q.shape[1] % kv_heads:
        fail(op, f"the query heads ({q.shape[1]}) must be a multiple of the KV heads ({kv_heads}) for GQA")
    require_tensor(op, "seq_lens", seq_lens)
    require_dtype(op, "seq_lens", seq_lens, INDEX_DTYPES)
    require_shape(op, "seq_lens", seq_lens, "[P]", (None,))
    require_same_device(op, "seq_lens", seq_lens, "k_cache", k_cache)
    seqs = seq_lens.shape[0]
    require_tensor(op, "query_start_loc", query_start_loc)
    require_dtype(op, "query_start_loc", query_start_loc, INDEX_DTYPES)
    require_shape(op, "query_start_loc", query_start_loc, "[P + 1]", (seqs + 1,))
    require_same_device(op, "query_start_loc", query_start_loc, "k_cache", k_cache)
    require_tensor(op, "block_tables", block_tables)
    require_dtype(op, "block_tables", block_tables, INDEX_DTYPES)
    require_shape(op, "block_tables", block_tables, "[P, max_blocks]", (seqs, None))
    require_same_device(op, "block_tables", block_tables, "k_cache", k_cache)
    _check_window(op, sliding_window)


def check_lora_prepare(token_slots: torch.Tensor, num_slots: int) -> None:
    op = "lora_prepare"
    require_tensor(op, "token_slots", token_slots)
    require_dtype(op, "token_slots", token_slots, INDEX_DTYPES)
    require_shape(op, "token_slots", token_slots, "[T]", (None,))
    if num_slots < 1:
        fail(op, f"num_slots must be >= 1, got {num_slots}")


def check_lora_slot_values(token_slots_host: torch.Tensor, num_slots: int) -> None:
    """Slots outside [-1, num_slots) would index past the adapter stacks."""
    if token_slots_host.numel() == 0:
        return
    low, high = int(token_slots_host.min()), int(token_slots_host.max())
    if low < -1 or high >= num_slots:
        fail("lora_prepare", f"token_slots must lie in [-1, {num_slots}), got values from {low} to {high}")


def check_lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, num_tokens: int, num_slots: int) -> None:
    op = "lora_shrink"
    require_tensor(op, "x", x)
    require_dtype(op, "x", x, FLOAT_DTYPES)
    require_shape(op, "x", x, "[T, in]", (num_tokens, None))
    require_rows(op, "x", x)
    require_tensor(op, "a_stack", a_stack)
    require_same_dtype(op, "a_stack", a_stack, "x", x)
    require_shape(op, "a_stack", a_stack, "[S, n_slices * R, in]", (None, None, x.shape[1]))
    require_contiguous(op, "a_stack", a_stack)
    require_same_device(op, "a_stack", a_stack, "x", x)
    if a_stack.shape[0] < num_slots:
        fail(op, f"a_stack must hold the {num_slots} slots of the LoraMeta, got {a_stack.shape[0]}")


def check_lora_expand(
    h: torch.Tensor,
    b_stack: torch.Tensor,
    slice_offsets: Sequence[int],
    y: torch.Tensor,
    num_tokens: int,
    num_slots: int,
) -> None:
    op = "lora_expand"
    require_tensor(op, "h", h)
    require_shape(op, "h", h, "[T, n_slices * R]", (num_tokens, None))
    require_contiguous(op, "h", h)
    check_lora_delta_target(op, b_stack, slice_offsets, y, num_tokens, num_slots, h.shape[1], "h.shape[1]")
    require_same_dtype(op, "h", h, "y", y)
    require_same_device(op, "h", h, "y", y)


def check_lora_delta_target(
    op: str,
    b_stack: torch.Tensor,
    slice_offsets: Sequence[int],
    y: torch.Tensor,
    num_tokens: int,
    num_slots: int,
    rank_rows: int,
    rows_name: str,
) -> None:
    """The expand half of a LoRA delta: column offsets, y, and B stacks for rank_rows (`rows_name`) = n_slices * R."""
    offsets = tuple(slice_offsets)
    if len(offsets) < 2 or offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        fail(op, f"slice_offsets must be n_slices + 1 >= 2 non-decreasing column offsets from 0, got {offsets}")
    n_slices, out_total = len(offsets) - 1, offsets[-1]
    require_tensor(op, "y", y)
    require_dtype(op, "y", y, FLOAT_DTYPES)
    require_shape(op, "y", y, "[T, out_total]", (num_tokens, out_total))
    require_rows(op, "y", y)
    if rank_rows % n_slices or rank_rows == 0:
        fail(op, f"{rows_name} ({rank_rows}) must be n_slices ({n_slices}) * R with R >= 1")
    rank = rank_rows // n_slices
    require_tensor(op, "b_stack", b_stack)
    require_same_dtype(op, "b_stack", b_stack, "y", y)
    require_shape(op, "b_stack", b_stack, "[S, out_total, R]", (None, out_total, rank))
    require_contiguous(op, "b_stack", b_stack)
    require_same_device(op, "b_stack", b_stack, "y", y)
    if b_stack.shape[0] < num_slots:
        fail(op, f"b_stack must hold the {num_slots} slots of the LoraMeta, got {b_stack.shape[0]}")


def check_slot_ranks(op: str, slot_ranks: torch.Tensor, max_rank: object, num_slots: int, rows: int) -> None:
    """The optional LoraMeta extension: per-slot ranks (int32 [>= S]) and the padded rank R they live in."""
    require_tensor(op, "meta.extra['slot_ranks']", slot_ranks)
    require_dtype(op, "meta.extra['slot_ranks']", slot_ranks, (torch.int32,))
    require_contiguous(op, "meta.extra['slot_ranks']", slot_ranks)
    if slot_ranks.dim() != 1 or slot_ranks.shape[0] < num_slots:
        fail(op, f"meta.extra['slot_ranks'] must have shape [>= {num_slots}], got {tuple(slot_ranks.shape)}")
    if not isinstance(max_rank, int) or max_rank < 1 or rows % max_rank:
        fail(op, f"meta.extra['max_rank'] must be the padded rank R dividing the {rows} rank rows, got {max_rank!r}")
