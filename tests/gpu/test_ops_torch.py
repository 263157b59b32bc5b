"""TorchOps against naive per-token reference loops (written here, in float64) on small random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from loraledger.gpu.ops_torch import TorchOps

OPS = TorchOps()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_rms_norm_with_and_without_residual():
    g = _gen(0)
    x, res, w = torch.randn(5, 12, generator=g), torch.randn(5, 12, generator=g), torch.randn(12, generator=g)
    for residual in (None, res):
        out, r = OPS.rms_norm(x, w, 1e-6, residual)
        for t in range(5):
            row = x[t].double() + (0 if residual is None else residual[t].double())
            expect = row / math.sqrt(float((row**2).mean()) + 1e-6) * w.double()
            torch.testing.assert_close(out[t].double(), expect, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(r[t].double(), row)


def test_rotary_embedding_rotates_each_pair_by_position():
    g = _gen(1)
    d, max_pos = 8, 32
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).double() / d))
    angles = torch.arange(max_pos).double()[:, None] * inv_freq[None, :]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
    positions = torch.tensor([0, 3, 31, 7])
    q, k = torch.randn(4, 3, d, generator=g), torch.randn(4, 1, d, generator=g)
    q_ref, k_ref = q.clone().double(), k.clone().double()
    OPS.rotary_embedding(positions, q, k, cache)
    for ref, got in ((q_ref, q), (k_ref, k)):
        for t, pos in enumerate(positions.tolist()):
            for h in range(ref.shape[1]):
                for i in range(d // 2):
                    a, b = ref[t, h, i].item(), ref[t, h, i + d // 2].item()
                    c, s = math.cos(angles[pos, i].item()), math.sin(angles[pos, i].item())
                    assert got[t, h, i].item() == pytest.approx(a * c - b * s, abs=1e-5)
                    assert got[t, h, i + d // 2].item() == pytest.approx(b * c + a * s, abs=1e-5)


def test_rotary_embedding_works_on_views_of_a_fused_qkv():
    g = _gen(2)
    d = 4
    cache = torch.randn(16, d, generator=g)
    qkv = torch.randn(3, 2 * d + 2 * d, generator=g)
    q, k = qkv[:, : 2 * d].view(3, 2, d), qkv[:, 2 * d : 3 * d].view(3, 1, d)
    q_alone, k_alone = q.clone(), k.clone()
    v_before = qkv[:, 3 * d :].clone()
    positions = torch.tensor([1, 5, 9])
    OPS.rotary_embedding(positions, q, k, cache)
    OPS.rotary_embedding(positions, q_alone, k_alone, cache)
    torch.testing.assert_close(qkv[:, : 2 * d].view(3, 2, d), q_alone)
    torch.testing.assert_close(qkv[:, 2 * d : 3 * d].view(3, 1, d), k_alone)
    torch.testing.assert_close(qkv[:, 3 * d :], v_before)


def test_silu_and_mul():
    x = torch.randn(4, 10, generator=_gen(3))
    out = OPS.silu_and_mul(x)
    for t in range(4):
        for j in range(5):
            a, b = x[t, j].item(), x[t, j + 5].item()
            assert out[t, j].item() == pytest.approx(a / (1 + math.exp(-a)) * b, rel=1e-5, abs=1e-6)


def test_write_kv_stores_each_token_at_its_slot():
    g = _gen(4)
    k_cache, v_cache = torch.zeros(6, 4, 2, 3), torch.zeros(6, 4, 2, 3)
    key, value = torch.randn(5, 2, 3, generator=g), torch.randn(5, 2, 3, generator=g)
    slots = torch.tensor([0, 13, 7, 22, 5])
    OPS.write_kv(key, value, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // 4, slot % 4], key[t])
        assert torch.equal(v_cache[slot // 4, slot % 4], value[t])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 5


def _naive_attention(q_row, k_cache, v_cache, table, pos, scale, window):
    """One query (all heads) at absolute position `pos`, reading keys 0..pos (in the window) via the table."""
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    hq = q_row.shape[0]
    lo = 0 if window is None else max(0, pos - window + 1)
    out = torch.zeros(hq, q_row.shape[1], dtype=torch.float64)
    for h in range(hq):
        kvh = h // (hq // hk)
        keys = [k_cache[table[j // block_size], j % block_size, kvh].double() for j in range(lo, pos + 1)]
        vals = [v_cache[table[j // block_size], j % block_size, kvh].double() for j in range(lo, pos + 1)]
        scores = torch.stack([q_row[h].double() @ kk for kk in keys]) * scale
        probs = torch.softmax(scores, 0)
        out[h] = sum(p * v for p, v in zip(probs, vals))
    return out


def _random_cache(g, num_blocks=24, block_size=4, hk=2, d=8):
    return torch.randn(num_blocks, block_size, hk, d, generator=g), torch.randn(
        num_blocks, block_size, hk, d, generator=g
    )


def _random_tables(g, seq_lens, block_size, num_blocks, width):
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)  # -1 padding must be harmless
    for b, n in enumerate(seq_lens):
        need = -(-n // block_size)
        tables[b, :need] = torch.tensor([perm.pop() for _ in range(need)], dtype=torch.int32)
    return tables


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq", [2, 4])
def test_paged_attention_decode_matches_naive(hq, window):
    g = _gen(5)
    k_cache, v_cache = _random_cache(g)
    seq_lens = [1, 9, 4, 13]
    tables = _random_tables(g, seq_lens, 4, 24, width=6)
    q = torch.randn(4, hq, 8, generator=g)
    out = OPS.paged_attention_decode(
        q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), 0.3, window
    )
    for b, n in enumerate(seq_lens):
        expect = _naive_attention(q[b], k_cache, v_cache, tables[b].tolist(), n - 1, 0.3, window)
        torch.testing.assert_close(out[b].double(), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_decode_bf16_stays_within_bf16_rounding_of_the_exact_one(window):
    # bf16 decode attention on the CPU runs SDPA on the bf16 K and V (no fp32 copies): still a softmax in fp32,
    # so the result is within bf16 rounding of the float64 one, at every sequence length and window
    g = _gen(6)
    k_cache, v_cache = _random_cache(g, d=64)
    seq_lens = [1, 9, 4, 13, 24]
    tables = _random_tables(g, seq_lens, 4, 24, width=6)
    q = torch.randn(5, 4, 64, generator=g)
    k16, v16, q16 = k_cache.bfloat16(), v_cache.bfloat16(), q.bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = OPS.paged_attention_decode(q16, k16, v16, tables, lens, 0.125, window)
    assert out.dtype == torch.bfloat16
    for b, n in enumerate(seq_lens):
        expect = _naive_attention(q16[b], k16, v16, tables[b].tolist(), n - 1, 0.125, window)
        torch.testing.assert_close(out[b].double(), expect, rtol=2e-2, atol=2e-2)


def test_one_torchops_serves_caches_of_many_shapes():
    """The context workspace grows for longer contexts but starts afresh for another cache shape: the
    GPU sweep's oracle alternates block sizes, and growing on every change once asked for petabytes."""
    g = _gen(13)
    ops = TorchOps()
    for i in range(48):
        block_size = (4, 8)[i % 2]
        k_cache, v_cache = _random_cache(g, num_blocks=6, block_size=block_size)
        seq_lens = [block_size + 1, 2]
        tables = _random_tables(g, seq_lens, block_size, 6, width=3)
        q = torch.randn(2, 2, 8, generator=g)
        got = ops.paged_attention_decode(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), 0.3)
        for b, n in enumerate(seq_lens):
            expect = _naive_attention(q[b], k_cache, v_cache, tables[b].tolist(), n - 1, 0.3, None)
            torch.testing.assert_close(got[b].double(), expect, rtol=1e-5, atol=1e-5)


def test_per_step_plans_are_reused_per_layer_and_rebuilt_for_a_new_step():
    """One TorchOps serves every layer of every step: what it derives once per step from the step's
    index tensors (context blocks, masks, rotary rows) must follow new tensors, equal-valued or not."""
    g = _gen(12)
    k_cache, v_cache = _random_cache(g)
    ops = TorchOps()
    steps = []
    for seq_lens in ([1, 9, 4, 13], [1, 9, 4, 13], [20, 2, 7, 5], [3]):  # the second: new tensors, same values
        tables = _random_tables(g, seq_lens, 4, 24, width=6)
        steps.append((torch.randn(len(seq_lens), 8, 8, generator=g), tables, torch.tensor(seq_lens, dtype=torch.int32)))
    for q, tables, lens in steps:
        for window in (None, None, 2):  # two "layers", then a sliding-window model's layer
            # the torch path, whose per-step plans are under test (on the CPU, paged_attention_decode runs the kernel)
            got = ops.gathered_attention_decode(q, k_cache, v_cache, tables, lens, 0.3, window)
            torch.testing.assert_close(
                got, TorchOps().gathered_attention_decode(q, k_cache, v_cache, tables, lens, 0.3, window)
            )
            for b, n in enumerate(lens.tolist()):
                expect = _naive_attention(q[b], k_cache, v_cache, tables[b].tolist(), n - 1, 0.3, window)
                torch.testing.assert_close(got[b].double(), expect, rtol=1e-5, atol=1e-5)
    cache = torch.randn(64, 8, generator=g)
    for positions in (torch.tensor([3, 9]), torch.tensor([3, 9]), torch.tensor([40, 1, 5])):
        for _ in range(2):
            q, k = (
                torch.randn(positions.shape[0], 4, 8, generator=g),
                torch.randn(positions.shape[0], 2, 8, generator=g),
            )
            q_ref, k_ref = q.clone(), k.clone()
            ops.rotary_embedding(positions, q, k, cache)
            TorchOps().rotary_embedding(positions, q_ref, k_ref, cache)
            assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


@pytest.mark.parametrize("window", [None, 3])
def test_prefill_attention_with_cached_prefix_matches_naive(window):
    g = _gen(6)
    k_cache, v_cache = _random_cache(g, hk=1)
    seq_lens = [7, 3, 12]
    q_lens = [7, 2, 5]  # first: no prefix; the others follow a cached prefix of 1 and 7 tokens
    tables = _random_tables(g, seq_lens, 4, 24, width=5)
    starts = torch.tensor([0, 7, 9, 14], dtype=torch.int32)
    q = torch.randn(14, 4, 8, generator=g)
    out = OPS.prefill_attention(
        q, k_cache, v_cache, starts, torch.tensor(seq_lens, dtype=torch.int32), tables, 0.25, window
    )
    for p, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        for i in range(ql):
            t = int(starts[p]) + i
            expect = _naive_attention(q[t], k_cache, v_cache, tables[p].tolist(), n - ql + i, 0.25, window)
            torch.testing.assert_close(out[t].double(), expect, rtol=1e-5, atol=1e-5)


def test_prefill_attention_single_sequence():
    g = _gen(7)
    k_cache, v_cache = _random_cache(g)
    tables = _random_tables(g, [6], 4, 24, width=2)
    q = torch.randn(6, 2, 8, generator=g)
    out = OPS.prefill_attention(
        q, k_cache, v_cache, torch.tensor([0, 6], dtype=torch.int32), torch.tensor([6], dtype=torch.int32), tables, 0.5
    )
    for i in range(6):
        expect = _naive_attention(q[i], k_cache, v_cache, tables[0].tolist(), i, 0.5, None)
        torch.testing.assert_close(out[i].double(), expect, rtol=1e-5, atol=1e-5)


def _lora_stacks(g, num_slots, rank, ranks, in_f, outs):
    """A [S, n*R, in] and B [S, sum(outs), R] with slot s using only its first ranks[s] rank columns."""
    n = len(outs)
    a = torch.randn(num_slots, n * rank, in_f, generator=g)
    b = torch.randn(num_slots, sum(outs), rank, generator=g)
    for s, r in enumerate(ranks):
        for m in range(n):
            a[s, m * rank + r : (m + 1) * rank] = 0
        b[s, :, r:] = 0
    return a, b


def _qkv_like_case(g, slots):
    """Four slots of ranks 8/2/4/1 (R = 8) on a 3-slice fused module; x, y0 and the plan for `slots`."""
    num_slots, rank, in_f, outs = 4, 8, 6, (5, 3, 3)
    a, b = _lora_stacks(g, num_slots, rank, ranks=[8, 2, 4, 1], in_f=in_f, outs=outs)
    x = torch.randn(len(slots), in_f, generator=g)
    y0 = torch.randn(len(slots), sum(outs), generator=g)
    meta = OPS.lora_prepare(torch.tensor(slots, dtype=torch.int32), num_slots)
    return rank, (0, 5, 8, 11), a, b, x, y0, meta


@pytest.mark.parametrize(
    "slots",
    [
        [2, -1, 0, 2, 1, -1, 0, 2, 2, 3],  # mixed, with base tokens and uneven groups
        [1, 1, 1],  # one adapter only
        [3, 2, 1, 0],  # every slot active
        [-1, -1],  # no adapter token at all
        [0] * 20 + [1, 2, -1, 1] + [-1] * 17 + [3] * 16 + [0, 2],  # long runs (own GEMMs) beside grouped tokens
        [2] * 18,  # one long run only
    ],
)
def test_lora_shrink_expand_match_per_token_loop(slots):
    rank, offsets, a, b, x, y0, meta = _qkv_like_case(_gen(8), slots)
    h = OPS.lora_shrink(x, a, meta)
    y = y0.clone()
    OPS.lora_expand(h, b, meta, offsets, y)
    for t, s in enumerate(slots):
        if s < 0:
            assert torch.equal(h[t], torch.zeros(3 * rank))
            assert torch.equal(y[t], y0[t])
            continue
        h_ref = a[s].double() @ x[t].double()
        torch.testing.assert_close(h[t].double(), h_ref, rtol=1e-5, atol=1e-5)
        y_ref = y0[t].double().clone()
        for m in range(3):
            for j in range(offsets[m], offsets[m + 1]):
                y_ref[j] += sum(h_ref[m * rank + r] * b[s, j, r].double() for r in range(rank))
        torch.testing.assert_close(y[t].double(), y_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "slots",
    [
        [2, -1, 0, 2, 1, -1, 0, 2, 2, 3],  # unsorted: gathered, scattered back with index_add_
        [-1, -1, 0, 0, 1, 1, 3, 3],  # sorted like decode, equal widths: views only, no gather
        [-1, 0, 0, 0, 1, 2, 2, 3, 3, 3],  # sorted, uneven widths: padded, compacted, added to a row slice
        [1, 1, 1],  # one adapter only
        [-1, -1],  # no adapter token at all
        [0, 0, 1, 2, 2] + [-1] * 3 + [3] * 16 + [1, 0],  # sorted decode part, a long run, then short chunks
        [2] * 18,  # one long run only
    ],
)
def test_lora_apply_equals_shrink_then_expand(slots):
    _, offsets, a, b, x, y0, meta = _qkv_like_case(_gen(10), slots)
    y_ref = y0.clone()
    OPS.lora_expand(OPS.lora_shrink(x, a, meta), b, meta, offsets, y_ref)
    y = y0.clone()
    OPS.lora_apply(x, a, b, meta, offsets, y)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    base = torch.tensor(slots) < 0
    assert torch.equal(y[base], y0[base]), "lora_apply changed a base-model token's row"


def test_lora_prepare_marks_sorted_decode_tokens_as_one_span():
    meta = OPS.lora_prepare(torch.tensor([-1, -1, 0, 0, 2, 2], dtype=torch.int32), 3)
    grouped = meta.extra["grouped"]
    assert grouped["span"] == (2, 6) and not grouped["padded"]
    meta = OPS.lora_prepare(torch.tensor([-1, 0, 2, 2], dtype=torch.int32), 3)
    assert meta.extra["grouped"]["span"] == (1, 4) and meta.extra["grouped"]["padded"]
    meta = OPS.lora_prepare(torch.tensor([0, -1, 0], dtype=torch.int32), 3)
    assert meta.extra["grouped"]["span"] is None


def test_lora_bf16_inputs_accumulate_in_fp32():
    g = _gen(9)
    a, b = _lora_stacks(g, 2, 4, ranks=[4, 4], in_f=64, outs=(16,))
    a16, b16 = a.bfloat16(), b.bfloat16()
    slots = torch.tensor([0, 1, -1] + [1] * 20, dtype=torch.int32)  # grouped tokens and one long run
    x16 = torch.randn(slots.shape[0], 64, generator=g).bfloat16()
    meta = OPS.lora_prepare(slots, 2)
    h16 = OPS.lora_shrink(x16, a16, meta)
    y16 = torch.zeros(slots.shape[0], 16, dtype=torch.bfloat16)
    OPS.lora_expand(h16, b16, meta, (0, 16), y16)
    assert h16.dtype == y16.dtype == torch.bfloat16
    # fp32 accumulation, rounded to bf16 once: within one bf16 ulp of the fp32 result
    idx = slots.clamp(min=0).long()
    h_ref = torch.einsum("toi,ti->to", a16.float()[idx], x16.float())
    y_ref = torch.einsum("tor,tr->to", b16.float()[idx], h16.float())
    h_ref[2], y_ref[2] = 0, 0
    torch.testing.assert_close(h16.float(), h_ref, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(y16.float(), y_ref, rtol=2**-7, atol=1e-6)
    fused = torch.zeros_like(y16)
    OPS.lora_apply(x16, a16, b16, meta, (0, 16), fused)
    torch.testing.assert_close(fused.float(), y_ref, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("native", [True, False])
def test_lora_apply_bf16_on_a_native_bf16_cpu_stays_within_bf16_rounding(native, monkeypatch):
    """With native bf16 the grouped bmm runs in bf16 (fp32 accumulation, no fp32 copy of the stacks): the delta
    stays within bf16 rounding of the fp32 computation, as without."""
    from loraledger.gpu import cpu_features

    monkeypatch.setattr(cpu_features, "native_bf16", lambda: native)
    g = _gen(11)
    a, b = _lora_stacks(g, 2, 4, ranks=[4, 4], in_f=64, outs=(16,))
    a16, b16 = a.bfloat16(), b.bfloat16()
    slots = torch.tensor([0, 1, -1, 1, 0, 0], dtype=torch.int32)  # grouped decode-sized batch
    x16 = torch.randn(slots.shape[0], 64, generator=g).bfloat16()
    meta = OPS.lora_prepare(slots, 2)
    y16 = torch.zeros(slots.shape[0], 16, dtype=torch.bfloat16)
    OPS.lora_apply(x16, a16, b16, meta, (0, 16), y16)
    idx = slots.clamp(min=0).long()
    h_ref = torch.einsum("toi,ti->to", a16.float()[idx], x16.float()).bfloat16().float()
    y_ref = torch.einsum("tor,tr->to", b16.float()[idx], h_ref)
    y_ref[2] = 0
    assert torch.equal(y16[2], torch.zeros(16, dtype=torch.bfloat16)), "a base-model row got a delta"
    torch.testing.assert_close(y16.float(), y_ref, rtol=2**-6, atol=1e-3)


@pytest.mark.parametrize(
    "x_dtype,stack_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)],
)
@pytest.mark.parametrize(
    "slots",
    [
        [0, 1, 2, 3, -1, 0, 1, 2, 3, -1],  # unsorted: gathered and scattered back
        [-1, -1, 0, 0, 1, 1, 2, 2, 3, 3],  # sorted like decode, equal widths
        [-1] * 3 + [3] * 16 + [0, 1, 2, -1],  # a long run beside grouped tokens
    ],
)
def test_base_rows_take_no_adapter_when_every_slot_is_full(slots, x_dtype, stack_dtype):
    """Every slot holds an adapter and the batch has base-model rows: those rows come out exactly as the base
    model left them (vLLM's CPU build sends them through the last slot's adapter)."""
    g = _gen(12)
    a, b = _lora_stacks(g, 4, 8, ranks=[8, 8, 8, 8], in_f=6, outs=(5, 3, 3))
    x = torch.randn(len(slots), 6, generator=g).to(x_dtype)
    y0 = torch.randn(len(slots), 11, generator=g).to(x_dtype)
    meta = OPS.lora_prepare(torch.tensor(slots, dtype=torch.int32), 4)
    y = y0.clone()
    OPS.lora_apply(x, a.to(stack_dtype), b.to(stack_dtype), meta, (0, 5, 8, 11), y)
    base = torch.tensor(slots) < 0
    assert torch.equal(y[base], y0[base]), "a base-model row got an adapter's delta"
    assert not torch.equal(y[~base], y0[~base]), "the adapter rows must change (the check would be empty)"


def _block_diagonal(b: torch.Tensor, offsets: tuple[int, ...], rank: int) -> torch.Tensor:
    """b [S, out_total, R] as the CPU slots hold it: [S, out_total, n*R], slice m in rank columns m*R..(m+1)*R."""
    n = len(offsets) - 1
    out = b.new_zeros(b.shape[0], b.shape[1], n * rank)
    for m in range(n):
        out[:, offsets[m] : offsets[m + 1], m * rank : (m + 1) * rank] = b[:, offsets[m] : offsets[m + 1]]
    return out


@pytest.mark.parametrize(
    "slots",
    [
        [2, -1, 0, 2, 1, -1, 0, 2, 2, 3],  # unsorted: gathered, scattered back
        [-1, -1, 0, 0, 1, 1, 3, 3],  # sorted like decode, equal widths
        [-1, 0, 0, 0, 1, 2, 2, 3, 3, 3],  # sorted, uneven widths
        [0, 0, 1, 2, 2] + [-1] * 3 + [3] * 16 + [1, 0],  # a long run beside grouped tokens
    ],
)
def test_block_diagonal_b_gives_the_per_slice_delta(slots):
    """A fused module's block-diagonal B (the CPU slots' layout: one expand product for all slices) gives the
    same delta as one B per slice, in lora_apply and lora_expand; base rows stay as they were."""
    rank, offsets, a, b, x, y0, meta = _qkv_like_case(_gen(13), slots)
    bd = _block_diagonal(b, offsets, rank)
    for run in (
        lambda bs, y: OPS.lora_apply(x, a, bs, meta, offsets, y),
        lambda bs, y: OPS.lora_expand(OPS.lora_shrink(x, a, meta), bs, meta, offsets, y),
    ):
        y_ref, y = y0.clone(), y0.clone()
        run(b, y_ref)
        run(bd, y)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        base = torch.tensor(slots) < 0
        assert torch.equal(y[base], y0[base]), "a base-model row got an adapter's delta"


def test_grouped_lora_products_run_on_one_thread_and_the_count_comes_back(monkeypatch):
    """The decode tokens' small products run on one intra-op thread (a second one waits at every barrier on a
    shared machine); the caller's thread count is restored afterwards."""
    seen = []
    real_bmm = torch.bmm

    def bmm(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_bmm(*args, **kwargs)

    monkeypatch.setattr(torch, "bmm", bmm)
    _, offsets, a, b, x, y0, meta = _qkv_like_case(_gen(14), [-1, 0, 0, 1, 2, 2, 3])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        OPS.lora_apply(x, a, b, meta, offsets, y0.clone())
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
