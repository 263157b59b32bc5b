"""Tests for gpu/kernel_checks.py: the checks accept the model's real layouts and refuse bad ones clearly."""

from __future__ import annotations

import pytest
import torch

from loraledger.errors import KernelInputError
from loraledger.gpu import kernel_checks as checks

T, H, HQ, HK, D = 3, 16, 4, 2, 8
BF16 = torch.bfloat16


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model has them: row-strided views of one fused projection output."""
    qkv = torch.randn(T, (HQ + 2 * HK) * D)
    q = qkv[:, : HQ * D].view(T, HQ, D)
    k = qkv[:, HQ * D : (HQ + HK) * D].view(T, HK, D)
    v = qkv[:, (HQ + HK) * D :].view(T, HK, D)
    return q, k, v


def _caches(block_size: int = 4, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(5, block_size, HK, D, dtype=dtype), torch.zeros(5, block_size, HK, D, dtype=dtype)


def test_the_models_layouts_pass():
    q, k, v = _qkv()
    kc, vc = _caches()
    checks.check_rms_norm(torch.randn(T, H), torch.randn(H), torch.randn(T, H))
    checks.check_rms_norm(torch.randn(T, H + 4)[:, :H], torch.randn(H), None)
    checks.check_rotary_embedding(torch.arange(T), q, k, torch.randn(32, D))
    checks.check_silu_and_mul(torch.randn(T, 2 * H))
    checks.check_write_kv(k, v, kc, vc, torch.arange(T))
    bt, lens = torch.zeros(T, 2, dtype=torch.int32), torch.ones(T, dtype=torch.int32)
    checks.check_paged_attention_decode(q, kc, vc, bt, lens, 4)
    checks.check_prefill_attention(
        q,
        kc,
        vc,
        torch.tensor([0, 1, 3], dtype=torch.int32),
        torch.tensor([4, 2], dtype=torch.int32),
        torch.zeros(2, 2, dtype=torch.int32),
        None,
    )
    checks.check_lora_prepare(torch.tensor([0, -1, 1], dtype=torch.int32), 2)
    checks.check_lora_shrink(torch.randn(T, H), torch.randn(2, 3 * 4, H), T, 2)
    checks.check_lora_expand(torch.randn(T, 3 * 4), torch.randn(2, 20, 4), (0, 10, 15, 20), torch.randn(T, 20), T, 2)


def _bad_cases():
    """(call, expected message) pairs: one wrong dtype / shape / stride / layout / device each."""
    q, k, v = _qkv()
    kc, vc = _caches()
    bt, lens = torch.zeros(T, 2, dtype=torch.int32), torch.ones(T, dtype=torch.int32)
    x, w = torch.randn(T, H), torch.randn(H)
    pos, cos_sin = torch.arange(T), torch.randn(8, D)
    slots = torch.arange(T)
    h8, y20, b4 = torch.randn(T, 8), torch.randn(T, 20), torch.randn(2, 20, 4)
    rms, rotary, write_kv = checks.check_rms_norm, checks.check_rotary_embedding, checks.check_write_kv
    decode, expand = checks.check_paged_attention_decode, checks.check_lora_expand

    # rms_norm
    yield lambda: rms(x.double(), w.double(), None), "rms_norm: x must be float32 or bfloat16 or float16, got float64"
    yield lambda: rms(x[None], w, None), r"rms_norm: x must have shape \[T, H\] = \(\*, \*\), got \(1, 3, 16\)"
    yield lambda: rms(x, torch.randn(H + 1), None), r"weight must have shape \[H\] = \(16\), got \(17,\)"
    yield lambda: rms(x, w, x.to(BF16)), "residual must have x's dtype float32, got bfloat16"
    yield lambda: rms(torch.randn(H, T).t(), w, None), r"x must have contiguous rows .* got strides \(1, 3\)"
    yield lambda: rms(x, torch.randn(2 * H)[::2], None), r"weight must be contiguous, got strides \(2,\)"
    yield (
        lambda: rms(torch.randn(T * H).as_strided((T, H), (4, 1)), w, None),
        r"x's rows must not overlap: stride\(0\) must be >= 16, got 4",
    )
    yield lambda: rms(x, "w", None), "rms_norm: weight must be a torch.Tensor, got str"
    # rotary_embedding, silu_and_mul
    yield (
        lambda: rotary(pos, torch.randn(T, HQ, 7), torch.randn(T, HK, 7), torch.randn(8, 7)),
        r"head_dim \(q.shape\[2\]\) must be even",
    )
    yield lambda: rotary(pos.float(), q, k, cos_sin), "positions must be int64 or int32, got float32"
    yield lambda: rotary(pos, q, k, cos_sin.to(BF16)), "cos_sin_cache must be float32, got bfloat16"
    yield lambda: rotary(pos, q, k[:, :, :4], cos_sin), r"k must have shape \[T, Hk, D\] = \(3, \*, 8\)"
    yield lambda: checks.check_silu_and_mul(torch.randn(T, 7)), r"x.shape\[1\] must be even"
    # write_kv
    yield lambda: write_kv(k, v, kc.transpose(2, 3), vc, slots), "write_kv: k_cache must be contiguous"
    yield (
        lambda: write_kv(k.to(BF16), v, kc, vc, slots),
        "write_kv: key must have k_cache's dtype float32, got bfloat16",
    )
    yield lambda: write_kv(k, v, kc, vc, torch.arange(T + 1)), r"slot_mapping must have shape \[T\] = \(3\), got \(4,\)"
    yield (
        lambda: write_kv(k.transpose(1, 2), v, kc, vc, slots),
        r"key must have shape \[T, Hk, D\] = \(\*, 2, 8\), got \(3, 8, 2\)",
    )
    yield lambda: write_kv(k, v, kc, vc.to(BF16), slots), "v_cache must have k_cache's dtype float32"
    # attention
    yield (
        lambda: decode(q, *_caches(block_size=3), bt, lens, None),
        r"block_size \(k_cache.shape\[1\]\) must be a power of two, got 3",
    )
    yield (
        lambda: decode(torch.randn(T, 3, D), kc, vc, bt, lens, None),
        r"the query heads \(3\) must be a multiple of the KV heads \(2\)",
    )
    yield lambda: decode(q, kc, vc, bt.long(), lens, None), "block_tables must be int32, got int64"
    yield lambda: decode(q, kc, vc, bt, lens[:2], None), r"seq_lens must have shape \[B\] = \(3\), got \(2,\)"
    yield lambda: decode(q, kc, vc, bt, lens, 0), "sliding_window must be None or an int >= 1, got 0"
    big = torch.zeros(1, 1, 2, 512)
    yield lambda: decode(torch.randn(1, 2, 512), big, big, bt[:1], lens[:1], None), "head_dim must be <= 256, got 512"
    yield (
        lambda: checks.check_prefill_attention(q, kc, vc, torch.tensor([0, 3]), torch.tensor([3, 1]), bt[:2], None),
        r"query_start_loc must have shape \[P \+ 1\] = \(3\), got \(2,\)",
    )
    # LoRA
    yield lambda: checks.check_lora_prepare(slots.view(1, T).int(), 2), r"token_slots must have shape \[T\]"
    yield lambda: checks.check_lora_prepare(torch.zeros(2, dtype=torch.int32), 0), "num_slots must be >= 1, got 0"
    yield (
        lambda: checks.check_lora_shrink(x, torch.randn(2, 4, H), T + 1, 2),
        r"lora_shrink: x must have shape \[T, in\] = \(4, \*\)",
    )
    yield (
        lambda: checks.check_lora_shrink(x, torch.randn(2, 4, H + 1), T, 2),
        r"a_stack must have shape \[S, n_slices \* R, in\] = \(\*, \*, 16\)",
    )
    yield (
        lambda: checks.check_lora_shrink(x, torch.randn(1, 4, H), T, 2),
        "a_stack must hold the 2 slots of the LoraMeta, got 1",
    )
    yield (
        lambda: expand(h8, b4, (1, 20), y20, T, 2),
        r"slice_offsets must be n_slices \+ 1 >= 2 non-decreasing column offsets from 0, got \(1, 20\)",
    )
    yield lambda: expand(torch.randn(T, 7), b4, (0, 10, 20), y20, T, 2), r"h.shape\[1\] \(7\) must be n_slices \(2\)"
    yield (
        lambda: expand(h8, torch.randn(2, 20, 3), (0, 10, 20), y20, T, 2),
        r"b_stack must have shape \[S, out_total, R\] = \(\*, 20, 4\), got \(2, 20, 3\)",
    )
    yield (
        lambda: expand(h8, b4, (0, 10, 20), torch.randn(T, 21), T, 2),
        r"y must have shape \[T, out_total\] = \(3, 20\), got \(3, 21\)",
    )
    # device
    yield (
        lambda: checks.require_device("rms_norm", "x", x, torch.device("cuda", 0)),
        r"rms_norm: x must be on cuda:0 \(the backend's device\), got cpu",
    )


@pytest.mark.parametrize("call, message", list(_bad_cases()))
def test_bad_inputs_are_refused_with_a_clear_message(call, message):
    with pytest.raises(KernelInputError, match=message):
        call()


def test_slot_values_and_slot_ranks_are_checked():
    checks.check_lora_slot_values(torch.tensor([-1, 0, 1]), 2)
    with pytest.raises(KernelInputError, match=r"token_slots must lie in \[-1, 2\), got values from -2 to 1"):
        checks.check_lora_slot_values(torch.tensor([-2, 1]), 2)
    ranks = torch.tensor([2, 4], dtype=torch.int32)
    checks.check_slot_ranks("lora_shrink", ranks, 4, 2, 12)
    with pytest.raises(KernelInputError, match=r"lora_shrink: meta.extra\['max_rank'\] must be the padded rank R"):
        checks.check_slot_ranks("lora_shrink", ranks, 5, 2, 12)
    with pytest.raises(KernelInputError, match=r"lora_expand: meta.extra\['slot_ranks'\] must have shape \[>= 3\]"):
        checks.check_slot_ranks("lora_expand", ranks, 4, 3, 12)
