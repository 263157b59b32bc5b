"""The CPU LoRA kernel (gpu/lora_cpu_kernel.py) equals its torch twin (TorchLoraOps' grouped path) on generated
inputs, builds warning-free, is cached by content, and where it cannot be built the torch path runs instead."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraledger.errors import KernelInputError
from loraledger.gpu import cpu_kernels, lora_cpu_kernel
from loraledger.gpu.ops_torch import TorchOps
from loraledger.lora.device_slots import slot_dtype
from tests.gpu.cpu_kernel_marks import CPU_KERNEL_TESTS

pytestmark = CPU_KERNEL_TESTS


def _rank_major(b: torch.Tensor) -> torch.Tensor:
    """[S, out, R] B as the rank-major view the kernel reads (the same values, other storage)."""
    return b.transpose(1, 2).contiguous().transpose(1, 2)


@st.composite
def cases(draw):
    widths = draw(st.lists(st.integers(1, 70), min_size=1, max_size=3))
    num_slots = draw(st.integers(1, 5))
    tokens = draw(st.integers(1, 20))
    return {
        "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "in_features": draw(st.integers(1, 90)),
        "widths": widths,
        "rank": draw(st.integers(1, 20)),
        "num_slots": num_slots,
        "slots": draw(st.lists(st.integers(-1, num_slots - 1), min_size=tokens, max_size=tokens)),
        "slot_ranks": draw(st.lists(st.integers(0, 20), min_size=num_slots, max_size=num_slots)),
        "seed": draw(st.integers(0, 2**16)),
    }


def _operands(case):
    g = torch.Generator().manual_seed(case["seed"])
    dtype, rank, n = case["dtype"], case["rank"], len(case["widths"])
    offsets = tuple(int(v) for v in np.concatenate(([0], np.cumsum(case["widths"]))))
    slots, out_total = case["num_slots"], offsets[-1]
    a = torch.randn(slots, n * rank, case["in_features"], generator=g)
    b = torch.randn(slots, out_total, rank, generator=g) * 0.5
    ranks = torch.tensor([min(r, rank) for r in case["slot_ranks"]], dtype=torch.int32)
    for s in range(slots):  # the zero padding past each slot's rank, as LoraSlots holds it
        for m in range(n):
            a[s, m * rank + int(ranks[s]) : (m + 1) * rank] = 0
        b[s, :, int(ranks[s]) :] = 0
    x = torch.randn(len(case["slots"]), case["in_features"], generator=g)
    y = torch.randn(len(case["slots"]), out_total, generator=g)
    return [t.to(dtype) for t in (a, b, x, y)] + [offsets, ranks]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_kernel_equals_the_torch_path_on_generated_inputs(case):
    """Any widths (tails past the 16-lane vectors), ranks, slot ranks below the padded rank, token orders and
    groups of any size, base rows (-1) among them: the kernel's y equals the torch path's, base rows untouched."""
    a, b, x, y0, offsets, ranks = _operands(case)
    ops = TorchOps()
    meta = ops.lora_prepare(torch.tensor(case["slots"], dtype=torch.int32), case["num_slots"])
    meta.extra["slot_ranks"] = ranks
    want, got = y0.clone(), y0.clone()
    ops.lora_apply(x, a, b, meta, offsets, want)  # "slices" B: the torch path
    rank_major = _rank_major(b)
    grouped = meta.extra.get("grouped")  # None: no adapter token, or only long runs (plain GEMMs)
    assert grouped is None or ops._kernel_for(x, a, rank_major, got, offsets, grouped) is not None
    ops.lora_apply(x, a, rank_major, meta, offsets, got)
    if case["dtype"] == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:  # h and the delta rounded to bf16 from fp32 sums taken in another order: a bf16 step apart at most
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=0.25)
    base = torch.tensor(case["slots"]) < 0
    assert torch.equal(got[base], y0[base]), "a base-model row got an adapter's delta"


def test_bf16_matches_the_torch_path_bit_for_bit_at_decode_shapes():
    """At the bench model's decode shapes (hidden 512, fused q/k/v, rank 16, 6 adapters + base rows sorted by slot)
    the kernel's bf16 y is the torch path's exactly: same roundings of h, the delta and the sum."""
    g = torch.Generator().manual_seed(7)
    offsets, rank, slots = (0, 512, 640, 768), 16, 6
    a = (torch.randn(slots, 3 * rank, 512, generator=g) * 0.05).bfloat16()
    b = (torch.randn(slots, 768, rank, generator=g) * 0.05).bfloat16()
    x = torch.randn(24, 512, generator=g).bfloat16()
    y0 = torch.randn(24, 768, generator=g).bfloat16()
    ops = TorchOps()
    meta = ops.lora_prepare(torch.tensor(sorted(i % 7 - 1 for i in range(24)), dtype=torch.int32), slots)
    want, got = y0.clone(), y0.clone()
    ops.lora_apply(x, a, b, meta, offsets, want)
    ops.lora_apply(x, a, _rank_major(b), meta, offsets, got)
    assert (got != want).sum().item() <= 0.001 * got.numel()


def _prefill_runs(dtype: torch.dtype, native_bf16: bool, monkeypatch) -> tuple[list, dict, torch.Tensor, torch.Tensor]:
    """Long same-adapter runs (prefill chunks) through lora_apply with a "slices" B (the torch path) and the same B
    rank-major (the kernel's layout): the group tables the kernel was called with, the plan, both results."""
    from loraledger.gpu import ops_torch_lora

    monkeypatch.setattr(ops_torch_lora.cpu_features, "native_bf16", lambda: native_bf16)
    calls = []
    original = ops_torch_lora.TorchLoraOps._kernel_grouped
    monkeypatch.setattr(
        ops_torch_lora.TorchLoraOps, "_kernel_grouped", lambda self, *a: calls.append(a[-2]) or original(self, *a)
    )
    g = torch.Generator().manual_seed(11)
    offsets, rank, slots = (0, 96, 128, 160), 8, 3
    a = (torch.randn(slots, 3 * rank, 96, generator=g) * 0.1).to(dtype)
    b = (torch.randn(slots, 160, rank, generator=g) * 0.1).to(dtype)
    token_slots = [0] * 40 + [-1] * 7 + [2] * 33 + [1] * 20
    x = torch.randn(len(token_slots), 96, generator=g).to(dtype)
    y0 = torch.randn(len(token_slots), 160, generator=g).to(dtype)
    ops = TorchOps()
    meta = ops.lora_prepare(torch.tensor(token_slots, dtype=torch.int32), slots)
    assert meta.extra["grouped"] is None and len(meta.extra["segments"]) == 3
    want, got = y0.clone(), y0.clone()
    ops.lora_apply(x, a, b, meta, offsets, want)
    assert not calls
    ops.lora_apply(x, a, _rank_major(b), meta, offsets, got)
    base = torch.tensor(token_slots) < 0
    assert torch.equal(got[base], y0[base])
    return calls, meta.extra, got, want


def _runs_for_the_kernel(extra: dict, limit: int | None) -> tuple[dict | None, list]:
    """The plan's entry for the kernel's runs at this run limit (its group table, the runs left to torch)."""
    assert [k for k in extra if isinstance(k, tuple)] == [("kernel_runs", limit)]
    return extra[("kernel_runs", limit)]


def _run_max(monkeypatch, tokens: int) -> None:
    """The kernel's fp32 run limit set to `tokens`, whatever this CPU's vectors."""
    monkeypatch.setattr(lora_cpu_kernel, "_RUN_MAX_8_LANES", tokens)
    monkeypatch.setattr(lora_cpu_kernel, "_RUN_MAX_16_LANES", tokens)


@pytest.mark.parametrize("lanes, limit", [(8, 96), (16, 256)])
def test_the_run_limit_follows_the_vectors_and_the_bf16_products(lanes, limit, monkeypatch):
    """fp32 runs up to 96 tokens with 8 lanes and 256 with 16; emulated bf16 every run; native bf16 256 tokens
    with vdpbf16ps and no AMX, else none (oneDNN's GEMMs); other dtypes none."""
    kernel = lora_cpu_kernel.load()
    monkeypatch.setattr(kernel, "lanes", lanes)
    assert kernel.run_limit(torch.float32, False) == limit
    assert kernel.run_limit(torch.bfloat16, False) is None
    assert kernel.run_limit(torch.float16, False) == 0
    for dot, amx, want in [(True, False, 256), (True, True, 0), (False, False, 0)]:
        monkeypatch.setattr(kernel, "bf16_dot", dot)
        monkeypatch.setattr(lora_cpu_kernel.cpu_features, "amx_bf16", lambda amx=amx: amx)
        assert kernel.run_limit(torch.bfloat16, True) == want


def test_fp32_prefill_runs_go_through_the_kernel_up_to_a_length(monkeypatch):
    """fp32 prefill chunks: the kernel takes the runs up to its run limit as groups (one call per module instead of
    a few small GEMMs per run), torch's GEMMs the longer ones; the delta is torch's within fp32 rounding and base
    rows stay untouched."""
    _run_max(monkeypatch, 96)
    calls, extra, got, want = _prefill_runs(torch.float32, False, monkeypatch)
    groups, rest = _runs_for_the_kernel(extra, 96)
    assert calls == [groups] and rest == []
    assert groups["bounds"].tolist() == [0, 40, 73, 93]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _run_max(monkeypatch, 35)  # the 40-token run goes to torch
    calls, extra, got, want = _prefill_runs(torch.float32, False, monkeypatch)
    groups, rest = _runs_for_the_kernel(extra, 35)
    assert calls == [groups] and rest == [(0, 40, 0)]
    assert groups["bounds"].tolist() == [0, 33, 53]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_prefill_runs_go_through_the_kernel_where_the_cpu_lacks_native_bf16(monkeypatch):
    """bf16 prefill chunks on a CPU without native bf16 products: the kernel takes every run, whatever its length,
    with the torch path's roundings (h and the delta to bf16)."""
    _run_max(monkeypatch, 1)
    calls, extra, got, want = _prefill_runs(torch.bfloat16, False, monkeypatch)
    groups, rest = _runs_for_the_kernel(extra, None)
    assert calls == [groups] and rest == []
    assert (got != want).sum().item() <= 0.01 * got.numel()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=0.05)


@pytest.mark.parametrize("dot, amx", [(True, False), (True, True), (False, False)])
def test_native_bf16_prefill_runs_go_to_the_kernel_only_with_vdpbf16ps_and_without_amx(dot, amx, monkeypatch):
    """With native bf16 products the kernel takes the runs up to 256 tokens where its bf16 products are vdpbf16ps
    and the CPU has no AMX; otherwise they are oneDNN's bf16 GEMMs. Either way the same delta within bf16
    rounding."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("needs oneDNN (torch.backends.mkldnn) for bf16 GEMMs")
    kernel = lora_cpu_kernel.load()
    monkeypatch.setattr(kernel, "bf16_dot", dot)
    monkeypatch.setattr(lora_cpu_kernel.cpu_features, "amx_bf16", lambda: amx)
    calls, extra, got, want = _prefill_runs(torch.bfloat16, True, monkeypatch)
    taken = dot and not amx
    groups, rest = _runs_for_the_kernel(extra, 256 if taken else 0)
    assert calls == ([groups] if taken else []) and rest == ([] if taken else extra["segments"])
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=0.05)


def test_the_stack_checks_are_made_once_per_pair_of_views_and_never_taken_for_another():
    """_kernel_for checks a module's stacks once per pair of views: a view of another layout (here a B that is
    not rank-major) is checked anew and goes to the torch path, and the cache stays bounded."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(4, 3 * 8, 64, generator=g)
    rank_major = torch.randn(4, 8, 96, generator=g).transpose(1, 2)
    plain = rank_major.contiguous()
    x, y = torch.randn(20, 64, generator=g), torch.zeros(20, 96)
    ops = TorchOps()
    meta = ops.lora_prepare(torch.tensor([0, 1] * 10, dtype=torch.int32), 4)
    offsets = (0, 32, 64, 96)
    assert ops._kernel_for(x, a, rank_major, y, offsets, meta.extra["grouped"]).kernel is lora_cpu_kernel.load()
    assert ops._kernel_for(x, a, plain, y, offsets, meta.extra["grouped"]) is None
    assert ops._kernel_for(x, a, rank_major, y, offsets, meta.extra["grouped"]).kernel is lora_cpu_kernel.load()
    assert ops._kernel_for(x, a.transpose(1, 2).contiguous().transpose(1, 2), rank_major, y, offsets,
                           meta.extra["grouped"]) is None  # fmt: skip
    for _ in range(4200):
        ops._stack_kernel(a[:], rank_major, offsets)
    assert len(ops._lora_stack_kernels) <= 4096
    moved = rank_major.clone().transpose(1, 2).contiguous().transpose(1, 2)  # rank-major, then changed in place
    assert ops._kernel_for(x, a, moved, y, offsets, meta.extra["grouped"]).kernel is lora_cpu_kernel.load()
    moved.as_strided_(moved.shape, (moved.shape[1] * moved.shape[2], moved.shape[2], 1))  # now "slices" strides
    assert ops._kernel_for(x, a, moved, y, offsets, meta.extra["grouped"]) is None


def test_where_it_cannot_be_built_the_torch_path_runs(monkeypatch):
    """No kernel (switched off here; every way a build fails is in test_cpu_kernels.py): block-diagonal slots, and
    a rank-major B handed to the ops anyway still gives the right delta through the torch path."""
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    assert lora_cpu_kernel.load() is None
    ops = TorchOps()
    assert ops.lora_b_layout(torch.float32, torch.device("cpu")) == "block_diagonal"
    # a rank-major B still gives the right delta, through the torch path
    case = {"dtype": torch.float32, "in_features": 33, "widths": [20, 9], "rank": 4, "num_slots": 2,
            "slots": [1, -1, 0, 1, 1], "slot_ranks": [4, 2], "seed": 3}  # fmt: skip
    a, b, x, y0, offsets, ranks = _operands(case)
    meta = ops.lora_prepare(torch.tensor(case["slots"], dtype=torch.int32), 2)
    want, got = y0.clone(), y0.clone()
    ops.lora_apply(x, a, b, meta, offsets, want)
    ops.lora_apply(x, a, _rank_major(b), meta, offsets, got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_operands_the_kernel_would_read_out_of_bounds_go_to_the_torch_path():
    """A slot past the stacks, fewer rows of x than tokens, slice columns past B, or an A of another slice count:
    never handed to the kernel (it reads without bounds); a slot out of range is refused when the step is planned."""
    case = {"dtype": torch.float32, "in_features": 40, "widths": [20, 12], "rank": 4, "num_slots": 3,
            "slots": [0, 2, -1, 1, 2], "slot_ranks": [4, 4, 4], "seed": 5}  # fmt: skip
    a, b, x, y, offsets, _ = _operands(case)
    ops = TorchOps()
    rank_major = _rank_major(b)
    grouped = ops.lora_prepare(torch.tensor(case["slots"], dtype=torch.int32), 3).extra["grouped"]
    assert ops._kernel_for(x, a, rank_major, y, offsets, grouped) is not None
    with pytest.raises(KernelInputError, match=r"token_slots must lie in \[-1, 3\), got values from 0 to 5"):
        ops.lora_prepare(torch.tensor([0, 5, 1], dtype=torch.int32), 3)
    assert ops._kernel_for(x, a[:2], rank_major[:2], y, offsets, grouped) is None  # slot 2 past 2 stacks
    assert ops._kernel_for(x[:4], a, rank_major, y[:4], offsets, grouped) is None  # 5 tokens, 4 rows
    assert ops._kernel_for(x, a, rank_major, y, (0, 20, 40), grouped) is None  # columns past B's 32
    assert ops._kernel_for(x, a, rank_major, y, (0, 20, 12), grouped) is None  # slices out of order
    assert ops._kernel_for(x, a[:, :4], rank_major, y, offsets, grouped) is None  # A of one slice for two


def test_the_cpu_slots_hold_b_rank_major_where_the_kernel_runs():
    ops = TorchOps()
    cpu = torch.device("cpu")
    assert ops.lora_b_layout(torch.float32, cpu) == "rank_major"
    # bf16 where the slots are bf16 (a CPU that multiplies bf16 natively); elsewhere they are fp32 and x is bf16
    native = slot_dtype(torch.bfloat16, cpu) == torch.bfloat16
    assert ops.lora_b_layout(torch.bfloat16, cpu) == ("rank_major" if native else "block_diagonal")
    assert ops.lora_b_layout(torch.float16, cpu) == "block_diagonal"  # fp16 models keep fp32 slots: no kernel


def test_slot_ranks_the_kernel_cannot_index_are_not_handed_to_it():
    """A strided or broadcast rank table would be read as if it were contiguous: the kernel gets none (every padded
    rank row is zero, so the result is the same, only slower)."""
    g = torch.Generator().manual_seed(12)
    offsets, rank, slots = (0, 40, 56), 8, 3
    a = torch.randn(slots, 2 * rank, 40, generator=g)
    b = torch.randn(slots, 56, rank, generator=g)
    for s, r in enumerate((8, 3, 5)):
        a[s, r:rank], a[s, rank + r :], b[s, :, r:] = 0, 0, 0
    x = torch.randn(12, 40, generator=g)
    y0 = torch.randn(12, 56, generator=g)
    ops = TorchOps()
    meta = ops.lora_prepare(torch.tensor([0, 1, 2, -1] * 3, dtype=torch.int32), slots)
    want = y0.clone()
    ops.lora_apply(x, a, b, meta, offsets, want)
    for ranks in (
        torch.tensor([8, -7, 3, -7, 5, -7], dtype=torch.int32)[::2],
        torch.tensor([8], dtype=torch.int32).expand(3),
    ):
        meta.extra["slot_ranks"] = ranks
        got = y0.clone()
        ops.lora_apply(x, a, _rank_major(b), meta, offsets, got)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_a_plan_never_hands_the_kernel_the_pointer_of_a_ranks_tensor_since_replaced():
    """The group table's pointers are taken once per plan; where the plan's slot ranks are replaced (or the same
    tensor resized) between two calls, the plan is made anew: the second call equals a fresh plan's, never a read of
    the freed tensor."""
    import gc

    g = torch.Generator().manual_seed(5)
    slots, rank, out = 4, 8, 32
    a = torch.randn(slots, rank, 48, generator=g)
    b = torch.randn(slots, rank, out, generator=g).transpose(1, 2)
    x = torch.randn(6, 48, generator=g)
    ops = TorchOps()
    token_slots = torch.tensor([0, 0, 1, 2, 3, 3], dtype=torch.int32)

    def apply(meta, ranks):
        meta.extra["slot_ranks"] = ranks
        y = torch.zeros(6, out)
        ops.lora_apply(x, a, b, meta, (0, out), y)
        return y

    meta = ops.lora_prepare(token_slots, slots)
    first = apply(meta, torch.full((slots,), 2, dtype=torch.int32))
    gc.collect()
    replaced = apply(meta, torch.full((slots,), rank, dtype=torch.int32))
    fresh = apply(ops.lora_prepare(token_slots, slots), torch.full((slots,), rank, dtype=torch.int32))
    assert not torch.equal(first, fresh)  # rank 2 of 8: the ranks are read
    assert torch.equal(replaced, fresh)
    ranks = torch.full((slots,), rank, dtype=torch.int32)
    apply(meta, ranks)
    ranks.resize_(2)  # the same tensor, too short for 4 slots now: the kernel runs without the ranks
    assert torch.equal(apply(meta, ranks), fresh)


def test_a_group_table_off_the_host_is_not_handed_to_the_kernel():
    """The kernel reads the group table's pointers as host memory: a plan made on another device goes to torch."""
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(3, 8, 48, generator=g), torch.randn(3, 8, 32, generator=g).transpose(1, 2)
    x, y = torch.randn(5, 48, generator=g), torch.zeros(5, 32)
    ops = TorchOps()
    grouped = ops.lora_prepare(torch.tensor([0, 1, 1, 2, 2], dtype=torch.int32), 3).extra["grouped"]
    assert ops._kernel_for(x, a, b, y, (0, 32), grouped) is not None
    assert ops._kernel_for(x, a, b, y, (0, 32), {**grouped, "host": False}) is None
