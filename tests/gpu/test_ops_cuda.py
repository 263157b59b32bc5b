"""Tests for gpu/ops_cuda.py: every CudaOps op against TorchOps (the oracle) on fresh random inputs.

The same checks run twice: on a GPU over a wide sweep (`gpu` marker; skipped, with the reason
printed, where no GPU or CuPy is present), and in the ordinary suite over small shapes through a
CPU emulation of the kernels (tests/gpu/cuda_emulation.py). Outputs a kernel allocates are
NaN-poisoned, in-place outputs start as NaN or random data, so an element a kernel never writes
fails. bf16/fp16 results are compared with TorchOps run in fp32 on the same (rounded) inputs.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import zlib
from collections.abc import Callable, Iterator
from unittest import mock

import pytest
import torch

from loraledger.errors import KernelInputError
from loraledger.gpu.ops_cuda import CudaOps
from loraledger.gpu.ops_cuda_attention import sdpa_prefill_attention
from loraledger.gpu.ops_cuda_lora import lora_segments, lora_tiles
from loraledger.gpu.ops_torch import TorchOps
from tests.gpu.cuda_emulation import EmulatedLauncher, emulation_problem
from tests.gpu.markers import requires_gpu

ORACLE = TorchOps()
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

OpsFactory = Callable[..., CudaOps]


@pytest.fixture(scope="module")
def emulated() -> OpsFactory:
    problem = emulation_problem()
    if problem is not None:
        pytest.skip(problem)
    launcher = EmulatedLauncher(sm_count=4)  # few SMs: long contexts get split, as on a GPU with many sequences
    return lambda lora_kernel="auto": CudaOps("cpu", lora_kernel=lora_kernel, launcher=launcher)


@pytest.fixture(scope="module")
def on_gpu() -> OpsFactory:
    built: dict[str, CudaOps] = {}
    return lambda lora_kernel="auto": built.setdefault(lora_kernel, CudaOps("cuda", lora_kernel=lora_kernel))


# ---- helpers ----


def _gen(*key: object) -> torch.Generator:
    """A generator seeded from the case itself: every case has its own inputs, the same on every run."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _rand(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, device: str, scale: float = 1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype=dtype, device=device)


def _oracle(t: torch.Tensor | None) -> torch.Tensor | None:
    """A CPU copy for TorchOps: floating tensors in fp32, so reduced-precision runs meet the exact math."""
    if t is None:
        return None
    return t.detach().cpu().float().clone() if t.is_floating_point() else t.detach().cpu().clone()


def assert_matches(name: str, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    got64, ref64 = got.detach().cpu().double(), ref.detach().cpu().double()
    assert got64.shape == ref64.shape, f"{name}: shape {tuple(got64.shape)} != {tuple(ref64.shape)}"
    assert not torch.isnan(got64).any(), f"{name}: NaN in the output (an element the kernel never wrote?)"
    err = ((got64 - ref64).abs().max() / ref64.abs().max().clamp(min=1e-6)).item() if got64.numel() else 0.0
    assert err <= TOL[dtype], f"{name}: relative error {err:.2e} above {TOL[dtype]:.0e} for {dtype}"


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """torch.empty / empty_like hand out NaN-filled floating tensors while a CudaOps op runs."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(math.nan) if t.is_floating_point() else t

    with (
        mock.patch.object(torch, "empty", lambda *a, **k: poison(empty(*a, **k))),
        mock.patch.object(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k))),
    ):
        yield


# ---- the checks, shared by the GPU sweep and the emulated one ----


def check_rms_norm(
    ops: CudaOps, device: str, dtype: torch.dtype, tokens: int, hidden: int, residual: bool, strided: bool
):
    g = _gen("rms", dtype, tokens, hidden, residual, strided)
    x = _rand(g, (tokens, hidden + 8 * strided), dtype, device)[:, :hidden]
    weight = _rand(g, (hidden,), dtype, device)
    res = _rand(g, (tokens, hidden), dtype, device) if residual else None
    with poisoned_allocations():
        out, r = ops.rms_norm(x, weight, 1e-6, res)
    ref_out, ref_r = ORACLE.rms_norm(_oracle(x), _oracle(weight), 1e-6, _oracle(res))
    assert_matches("rms_norm out", out, ref_out, dtype)
    assert_matches("rms_norm residual", r, ref_r, dtype)
    if not residual:
        assert r is x


def check_rotary(ops: CudaOps, device: str, dtype: torch.dtype, tokens: int, hq: int, hk: int, d: int, index):
    g = _gen("rotary", dtype, tokens, hq, hk, d, index)
    max_pos = 64
    qkv = _rand(g, (tokens, (hq + 2 * hk) * d), dtype, device)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    v_before = qkv[:, (hq + hk) * d :].clone()
    positions = torch.randint(0, max_pos, (tokens,), generator=g).to(dtype=index, device=device)
    cache = _rand(g, (max_pos, d), F32, device)
    ref_q, ref_k = _oracle(q), _oracle(k)
    ORACLE.rotary_embedding(positions.cpu().long(), ref_q, ref_k, cache.cpu())
    ops.rotary_embedding(positions, q, k, cache)
    assert_matches("rotary q", q, ref_q, dtype)
    assert_matches("rotary k", k, ref_k, dtype)
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before), "rotary_embedding wrote outside q and k"


def check_silu_and_mul(ops: CudaOps, device: str, dtype: torch.dtype, tokens: int, inter: int):
    x = _rand(_gen("silu", dtype, tokens, inter), (tokens, 2 * inter), dtype, device, scale=3.0)
    with poisoned_allocations():
        out = ops.silu_and_mul(x)
    assert_matches("silu_and_mul", out, ORACLE.silu_and_mul(_oracle(x)), dtype)


def check_write_kv(ops: CudaOps, device: str, dtype: torch.dtype, tokens: int, block_size: int, hk: int, d: int, index):
    g = _gen("write_kv", dtype, tokens, block_size, hk, d, index)
    num_blocks = _cdiv(tokens, block_size) + 2
    k_cache = torch.full((num_blocks, block_size, hk, d), math.nan, dtype=dtype, device=device)
    v_cache = k_cache.clone()
    qkv = _rand(g, (tokens, 3 * hk * d), dtype, device)  # key / value as row-strided views, as the model has them
    key, value = qkv[:, hk * d : 2 * hk * d].view(tokens, hk, d), qkv[:, 2 * hk * d :].view(tokens, hk, d)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(dtype=index, device=device)
    ref_k, ref_v = _oracle(k_cache), _oracle(v_cache)
    ORACLE.write_kv(_oracle(key), _oracle(value), ref_k, ref_v, slots.cpu().long())
    ops.write_kv(key, value, k_cache, v_cache, slots)
    for name, got, ref in (("k_cache", k_cache, ref_k), ("v_cache", v_cache, ref_v)):
        got = got.cpu().float()
        assert torch.equal(got.isnan(), ref.isnan()), f"write_kv: {name} written at the wrong slots"
        assert torch.equal(got.nan_to_num(), ref.nan_to_num()), f"write_kv: {name} values differ"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _paged_context(g, seqs: int, hk: int, d: int, block_size: int, max_context: int, dtype, device):
    """Random caches and block tables; table padding points at a block of huge values that must never be read."""
    lens = torch.randint(1, max_context + 1, (seqs,), generator=g)
    lens[0] = max_context
    blocks = [_cdiv(int(n), block_size) for n in lens]
    width = max(blocks)
    num_blocks = sum(blocks) + 1
    poison = num_blocks - 1
    k_cache = _rand(g, (num_blocks, block_size, hk, d), dtype, device)
    v_cache = _rand(g, (num_blocks, block_size, hk, d), dtype, device)
    k_cache[poison] = 1e4
    v_cache[poison] = 1e4
    order = torch.randperm(num_blocks - 1, generator=g).tolist()
    table = torch.full((seqs, width), poison, dtype=torch.int32)
    for s, n in enumerate(blocks):
        table[s, :n] = torch.tensor(order[:n], dtype=torch.int32)
        del order[:n]
    return k_cache, v_cache, table.to(device), lens.to(dtype=torch.int32, device=device)


def check_decode(
    ops: CudaOps,
    device: str,
    dtype: torch.dtype,
    seqs: int,
    hq: int,
    hk: int,
    d: int,
    block_size: int,
    max_context: int,
    window: int | None,
):
    g = _gen("decode", dtype, seqs, hq, hk, d, block_size, max_context, window)
    k_cache, v_cache, table, lens = _paged_context(g, seqs, hk, d, block_size, max_context, dtype, device)
    q = _rand(g, (seqs, (hq + 2 * hk) * d), dtype, device)[:, : hq * d].view(seqs, hq, d)  # q of a fused qkv
    scale = d**-0.5
    with poisoned_allocations():
        out = ops.paged_attention_decode(q, k_cache, v_cache, table, lens, scale, window)
    ref = ORACLE.paged_attention_decode(
        _oracle(q), _oracle(k_cache), _oracle(v_cache), table.cpu(), lens.cpu(), scale, window
    )
    assert_matches(f"decode hq={hq} hk={hk} d={d} bs={block_size} ctx={max_context} w={window}", out, ref, dtype)


def _slot_runs(g, tokens: int, num_slots: int) -> torch.Tensor:
    """Runs of consecutive tokens per slot (prefill-like), base-model tokens (-1) included."""
    slots = torch.empty(tokens, dtype=torch.int32)
    at = 0
    while at < tokens:
        run = int(torch.randint(1, 12, (1,), generator=g))
        slots[at : at + run] = int(torch.randint(-1, num_slots, (1,), generator=g))
        at += run
    slots[-1] = -1
    return slots


def check_lora(
    make_ops: OpsFactory,
    device: str,
    dtype: torch.dtype,
    mode: str,
    tokens: int,
    hidden: int,
    rank: int,
    outs: tuple[int, ...],
    runs: bool,
):
    g = _gen("lora", dtype, mode, tokens, hidden, rank, outs, runs)
    ops = make_ops(mode)
    num_slots = 4
    n = len(outs)
    offsets = (0, *itertools.accumulate(outs))
    slots = _slot_runs(g, tokens, num_slots) if runs else torch.randint(-1, num_slots, (tokens,), generator=g).int()
    x = _rand(g, (tokens, hidden + 8), dtype, device)[:, :hidden]  # a row-strided view
    a = _rand(g, (num_slots, n * rank, hidden), dtype, device, scale=hidden**-0.5)
    b = _rand(g, (num_slots, offsets[-1], rank), dtype, device)
    meta = ops.lora_prepare(slots.to(device), num_slots)
    ref_meta = ORACLE.lora_prepare(slots, num_slots)
    with poisoned_allocations():
        h = ops.lora_shrink(x, a, meta)
    assert_matches(f"lora_shrink {mode}", h, ORACLE.lora_shrink(_oracle(x), _oracle(a), ref_meta), dtype)

    h_in = _rand(g, (tokens, n * rank), dtype, device)
    y = _rand(g, (tokens, offsets[-1]), dtype, device)
    y_before = y.clone()
    ref_y = _oracle(y)
    ORACLE.lora_expand(_oracle(h_in), _oracle(b), ref_meta, offsets, ref_y)
    ops.lora_expand(h_in, b, meta, offsets, y)
    assert_matches(f"lora_expand {mode}", y, ref_y, dtype)
    base = slots.to(device) < 0
    assert torch.equal(y[base], y_before[base]), "lora_expand changed a base-model token's row"

    # lora_apply: the fused kernel where the mode and the GPU pick it, else shrink then expand
    y = _rand(g, (tokens, offsets[-1] + 8), dtype, device)[:, : offsets[-1]]  # a row-strided view, as q/k/v's y
    y_before = y.clone()
    ref_y = _oracle(y)
    ORACLE.lora_apply(_oracle(x), _oracle(a), _oracle(b), ref_meta, offsets, ref_y)
    ops.lora_apply(x, a, b, meta, offsets, y)
    assert_matches(f"lora_apply {mode}", y, ref_y, dtype)
    assert torch.equal(y[base], y_before[base]), "lora_apply changed a base-model token's row"


# ---- emulated: the ordinary suite, no GPU ----


@pytest.mark.parametrize(
    "dtype, tokens, hidden, residual, strided",
    [(F32, 3, 100, True, True), (F32, 2, 64, False, False), (BF16, 2, 64, True, True), (F16, 1, 72, True, False)],
)
def test_rms_norm_emulated(emulated, dtype, tokens, hidden, residual, strided):
    check_rms_norm(emulated(), "cpu", dtype, tokens, hidden, residual, strided)


@pytest.mark.parametrize(
    "dtype, tokens, hq, hk, d, index", [(F32, 3, 4, 2, 16, torch.int64), (BF16, 2, 3, 1, 10, torch.int32)]
)
def test_rotary_embedding_emulated(emulated, dtype, tokens, hq, hk, d, index):
    check_rotary(emulated(), "cpu", dtype, tokens, hq, hk, d, index)


@pytest.mark.parametrize("dtype, tokens, inter", [(F32, 3, 64), (BF16, 2, 10), (F16, 1, 24)])
def test_silu_and_mul_emulated(emulated, dtype, tokens, inter):
    check_silu_and_mul(emulated(), "cpu", dtype, tokens, inter)


@pytest.mark.parametrize(
    "dtype, tokens, block_size, hk, d, index",
    [(F32, 5, 4, 2, 16, torch.int64), (BF16, 3, 1, 1, 10, torch.int32), (F16, 4, 8, 2, 8, torch.int64)],
)
def test_write_kv_emulated(emulated, dtype, tokens, block_size, hk, d, index):
    check_write_kv(emulated(), "cpu", dtype, tokens, block_size, hk, d, index)


@pytest.mark.parametrize(
    "dtype, seqs, hq, hk, d, block_size, max_context, window",
    [
        (F32, 3, 4, 2, 16, 4, 40, None),  # GQA 2, one split
        (F32, 2, 14, 2, 80, 1, 300, 64),  # Qwen2-like GQA 7, block size 1, sliding window
        (F32, 2, 4, 4, 160, 8, 530, None),  # fp32 head above 128: two packs per lane; split context
        (BF16, 2, 8, 1, 128, 16, 600, None),  # MQA, split context, bf16
        (F16, 2, 16, 1, 10, 128, 300, 7),  # two passes of 8 heads, odd head_dim, tiny window
    ],
)
def test_paged_attention_decode_emulated(emulated, dtype, seqs, hq, hk, d, block_size, max_context, window):
    check_decode(emulated(), "cpu", dtype, seqs, hq, hk, d, block_size, max_context, window)


@pytest.mark.parametrize("mode", ["bgmv", "sgmv", "fused"])
@pytest.mark.parametrize(
    "dtype, tokens, hidden, rank, outs, runs",
    [
        (F32, 19, 64, 8, (48,), True),
        (BF16, 12, 40, 3, (16, 8, 8), True),
        (F32, 5, 30, 1, (24, 20), False),  # in_features and rank off the 16-byte packs: scalar paths
        (BF16, 3, 200, 8, (72, 5), False),  # K-slices of 32: the last cluster blocks get none; 77 columns
    ],
)
def test_lora_emulated(emulated, mode, dtype, tokens, hidden, rank, outs, runs):
    check_lora(emulated, "cpu", dtype, mode, tokens, hidden, rank, outs, runs)


def test_fused_lora_needs_clusters():
    """Before compute capability 9.0 (no thread block clusters) "auto" keeps the two kernels; "fused" is refused."""
    problem = emulation_problem()
    if problem is not None:
        pytest.skip(problem)
    launcher = EmulatedLauncher(sm_count=4, compute_capability=(8, 0))
    g = _gen("no-clusters")
    x, a, b = _rand(g, (3, 32), F32, "cpu"), _rand(g, (2, 4, 32), F32, "cpu"), _rand(g, (2, 12, 4), F32, "cpu")
    slots = torch.tensor([1, -1, 0], dtype=torch.int32)
    ref_y = torch.zeros(3, 12)
    ORACLE.lora_apply(x, a, b, ORACLE.lora_prepare(slots, 2), (0, 12), ref_y)
    auto = CudaOps("cpu", launcher=launcher)
    y = torch.zeros(3, 12)
    auto.lora_apply(x, a, b, auto.lora_prepare(slots, 2), (0, 12), y)
    assert_matches("lora_apply without clusters", y, ref_y, F32)
    fused = CudaOps("cpu", lora_kernel="fused", launcher=launcher)
    with pytest.raises(KernelInputError, match=r"fused LoRA kernel needs compute capability 9\.0"):
        fused.lora_apply(x, a, b, fused.lora_prepare(slots, 2), (0, 12), y)


def test_lora_skips_rank_rows_past_slot_ranks_emulated(emulated):
    ops = emulated("bgmv")
    g = _gen("slot_ranks")
    rank, hidden, tokens = 4, 32, 6
    slots = torch.tensor([0, 1, 1, -1, 0, 1], dtype=torch.int32)
    x = _rand(g, (tokens, hidden), F32, "cpu")
    a = _rand(g, (2, 2 * rank, hidden), F32, "cpu")
    meta = ops.lora_prepare(slots, 2)
    meta.extra.update(slot_ranks=torch.tensor([2, 4], dtype=torch.int32), max_rank=rank)
    h = ops.lora_shrink(x, a, meta)
    a_masked = a.clone()
    a_masked[0, [2, 3, 6, 7]] = 0.0  # slot 0 has rank 2 in each of the two slices
    ref_meta = ORACLE.lora_prepare(slots, 2)
    assert_matches("slot_ranks shrink", h, ORACLE.lora_shrink(x, a_masked, ref_meta), F32)
    b = _rand(g, (2, 12, rank), F32, "cpu")
    b_masked = b.clone()
    b_masked[0, :, 2:] = 0.0
    y, ref_y = torch.zeros(tokens, 12), torch.zeros(tokens, 12)
    ops.lora_expand(h, b, meta, (0, 5, 12), y)
    ORACLE.lora_expand(h, b_masked, ref_meta, (0, 5, 12), ref_y)
    assert_matches("slot_ranks expand", y, ref_y, F32)
    fused = emulated("fused")
    y, ref_y = torch.zeros(tokens, 12), torch.zeros(tokens, 12)
    fused.lora_apply(x, a, b, meta, (0, 5, 12), y)
    ORACLE.lora_apply(x, a_masked, b_masked, ref_meta, (0, 5, 12), ref_y)
    assert_matches("slot_ranks fused", y, ref_y, F32)


# ---- CPU logic that needs no kernel ----


class _NoLaunch:
    sm_count = 4
    compute_capability = (9, 0)

    def launch(self, *args, **kwargs):
        raise AssertionError("this op should not launch a kernel")


def test_lora_segments_and_tiles():
    slots = torch.tensor([3, 3, 3, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3], dtype=torch.int64)
    indptr, seg_slots = lora_segments(slots)
    assert indptr.tolist() == [0, 3, 5, 20, 21]
    assert seg_slots.tolist() == [3, -1, 0, 3]
    assert lora_tiles(indptr, 8).tolist() == [0, 3, 5, 13, 20, 21]
    empty_indptr, empty_slots = lora_segments(torch.zeros(0, dtype=torch.int64))
    assert empty_indptr.tolist() == [0] and empty_slots.numel() == 0
    assert lora_tiles(empty_indptr, 8).tolist() == [0]


def test_lora_prepare_builds_the_tables_and_rejects_bad_slots():
    ops = CudaOps("cpu", launcher=_NoLaunch())
    meta = ops.lora_prepare(torch.tensor([1, 1, -1, 0], dtype=torch.int32), 2)
    assert meta.token_slots.dtype == torch.int32 and meta.num_slots == 2
    assert meta.extra["seg_indptr"].tolist() == [0, 2, 3, 4]
    assert meta.extra["seg_slots"].tolist() == [1, -1, 0]
    assert meta.extra["tile_starts"].tolist() == [0, 2, 3, 4] and meta.extra["num_tiles"] == 3
    assert meta.extra["any_adapter"]
    with pytest.raises(KernelInputError, match=r"token_slots must lie in \[-1, 2\), got values from -1 to 2"):
        ops.lora_prepare(torch.tensor([0, 2, -1], dtype=torch.int32), 2)


def test_lora_without_adapter_tokens_launches_nothing():
    ops = CudaOps("cpu", launcher=_NoLaunch())
    meta = ops.lora_prepare(torch.full((3,), -1, dtype=torch.int32), 2)
    h = ops.lora_shrink(torch.randn(3, 8), torch.randn(2, 4, 8), meta)
    assert torch.equal(h, torch.zeros(3, 4))
    y = torch.randn(3, 6)
    y_before = y.clone()
    ops.lora_expand(torch.randn(3, 4), torch.randn(2, 6, 2), meta, (0, 3, 6), y)
    assert torch.equal(y, y_before)


def test_lora_refuses_a_meta_from_another_backend():
    ops = CudaOps("cpu", launcher=_NoLaunch())
    meta = ORACLE.lora_prepare(torch.tensor([0, 1], dtype=torch.int32), 2)
    with pytest.raises(KernelInputError, match="lora_shrink: meta must come from CudaOps.lora_prepare"):
        ops.lora_shrink(torch.randn(2, 8), torch.randn(2, 4, 8), meta)


@pytest.mark.parametrize("window", [None, 5])
def test_sdpa_prefill_attention_matches_torchops(window):
    g = _gen("prefill", window)
    hq, hk, d, block_size = 6, 2, 16, 4
    q_lens, seq_lens = [3, 1, 7], [10, 1, 7]  # a chunk after a cached prefix, a lone token, a whole prompt
    k_cache, v_cache, table, _ = _paged_context(g, 3, hk, d, block_size, max(seq_lens), F32, "cpu")
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    starts = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    got = sdpa_prefill_attention(q, k_cache, v_cache, starts, lens, table, d**-0.5, window)
    ref = ORACLE.prefill_attention(q, k_cache, v_cache, starts, lens, table, d**-0.5, window)
    assert_matches("prefill", got, ref, F32)


def test_prefill_attention_reads_the_sizes_back_once_per_step():
    """Each read-back drains the GPU's launch queue: the layers of one step share one."""
    import loraledger.gpu.ops_cuda_attention as attention

    g = _gen("prefill-once")
    ops = CudaOps("cpu", launcher=_NoLaunch())
    k_cache, v_cache, table, _ = _paged_context(g, 2, 2, 16, 4, 9, F32, "cpu")
    q = torch.randn(7, 4, 16, generator=g)
    with mock.patch.object(attention, "prefill_sizes", wraps=attention.prefill_sizes) as sizes:
        for step in range(2):  # each step builds its index tensors afresh, as build_forward_batch does
            starts = torch.tensor([0, 3, 7], dtype=torch.int32)
            lens = torch.tensor([9, 4], dtype=torch.int32)
            outs = [ops.prefill_attention(q, k_cache, v_cache, starts, lens, table, 0.25) for _layer in range(3)]
            assert sizes.call_count == step + 1
            ref = ORACLE.prefill_attention(q, k_cache, v_cache, starts, lens, table, 0.25)
            for out in outs:
                assert_matches("prefill", out, ref, F32)


# ---- on a GPU: the full sweep ----

LORA_GPU_CASES = [
    # tokens, hidden, rank, outs, runs: decode batches (one token per sequence) and prefill runs
    (1, 896, 1, (896,), False),
    (16, 896, 8, (896, 128, 128), False),
    (128, 4096, 16, (4096, 1024, 1024), False),
    (64, 8192, 16, (8192,), False),
    (600, 4096, 16, (4096, 1024, 1024), True),
    (300, 4864, 7, (896,), True),
]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("hidden", [896, 4096, 8192])
@pytest.mark.parametrize("tokens", [1, 7, 128])
def test_rms_norm_gpu(on_gpu, dtype, hidden, tokens):
    for residual, strided in ((False, False), (True, False), (True, True)):
        check_rms_norm(on_gpu(), "cuda", dtype, tokens, hidden, residual, strided)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("hq, hk, d", [(14, 2, 64), (32, 8, 128), (8, 8, 80)])
def test_rotary_embedding_gpu(on_gpu, dtype, hq, hk, d):
    for tokens, index in ((1, torch.int64), (33, torch.int64), (128, torch.int32)):
        check_rotary(on_gpu(), "cuda", dtype, tokens, hq, hk, d, index)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("tokens, inter", [(1, 4864), (64, 14336), (7, 1000)])
def test_silu_and_mul_gpu(on_gpu, dtype, tokens, inter):
    check_silu_and_mul(on_gpu(), "cuda", dtype, tokens, inter)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_write_kv_gpu(on_gpu, dtype, block_size):
    for tokens, hk, d, index in ((1, 2, 64, torch.int64), (40, 8, 128, torch.int64), (9, 1, 80, torch.int32)):
        check_write_kv(on_gpu(), "cuda", dtype, tokens, block_size, hk, d, index)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("block_size", [1, 2, 16, 32, 128])
@pytest.mark.parametrize("hq, hk, d", [(14, 2, 64), (32, 8, 128), (16, 16, 256), (28, 4, 128)])
def test_paged_attention_decode_gpu(on_gpu, dtype, block_size, hq, hk, d):
    for seqs, max_context, window in ((1, 1, None), (5, 17, None), (128, 200, None), (3, 3000, None), (8, 3000, 256)):
        check_decode(on_gpu(), "cuda", dtype, seqs, hq, hk, d, block_size, max_context, window)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_prefill_attention_gpu(on_gpu, dtype):
    g = _gen("prefill-gpu", dtype)
    hq, hk, d, block_size = 28, 4, 128, 16
    q_lens, seq_lens = [30, 1, 257], [100, 1, 257]
    k_cache, v_cache, table, _ = _paged_context(g, 3, hk, d, block_size, max(seq_lens), dtype, "cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    q = _rand(g, (sum(q_lens), hq, d), dtype, "cuda")
    for window in (None, 64):
        got = on_gpu().prefill_attention(q, k_cache, v_cache, starts, lens, table, d**-0.5, window)
        ref = ORACLE.prefill_attention(
            _oracle(q), _oracle(k_cache), _oracle(v_cache), starts.cpu(), lens.cpu(), table.cpu(), d**-0.5, window
        )
        assert_matches(f"prefill w={window}", got, ref, dtype)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("mode", ["bgmv", "sgmv", "fused", "auto"])
@pytest.mark.parametrize("tokens, hidden, rank, outs, runs", LORA_GPU_CASES)
def test_lora_gpu(on_gpu, dtype, mode, tokens, hidden, rank, outs, runs):
    check_lora(on_gpu, "cuda", dtype, mode, tokens, hidden, rank, outs, runs)


@pytest.mark.gpu
@requires_gpu
def test_wrappers_refuse_tensors_on_another_device(on_gpu):
    with pytest.raises(KernelInputError, match=r"rms_norm: x must be on cuda:\d"):
        on_gpu().rms_norm(torch.randn(2, 8), torch.randn(8), 1e-6)
