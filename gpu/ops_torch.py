"""TorchOps: the device ops in plain torch; the CPU path and the oracle the CUDA kernels are tested against."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from loraledger.gpu import cpu_features
from loraledger.gpu.ops import LoraMeta, Ops, StepMemo, slot_runs

_REDUCED = (torch.bfloat16, torch.float16)
# a run of at least this many same-adapter tokens gets its own GEMMs instead of the grouped bmm
_SEGMENT_MIN = 16


class TorchOps(Ops):
    name = "torch"
    # one expand product per fused module instead of one per slice: fewer small ops where each costs microseconds
    lora_block_diagonal = True

    def __init__(self) -> None:
        self._kv_workspace: torch.Tensor | None = None
        # what every layer would otherwise rebuild from the step's index tensors (see StepMemo)
        self._step_memo = StepMemo()

    def _per_step(self, name: str, key: tuple, build):
        """build(), reused while `key` holds the same objects (StepMemo): once per step, not per layer."""
        return self._step_memo.get(name, key, build)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r = x if residual is None else x + residual
        rf = r.float()
        out = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)
        return (out * weight.float()).to(x.dtype), r

    def rotary_embedding(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> None:
        half = cos_sin_cache.shape[-1] // 2

        def gather():
            cs = cos_sin_cache.index_select(0, positions)
            return cs[:, None, :half], cs[:, None, half:]

        cos, sin = self._per_step("rotary", (positions, cos_sin_cache), gather)
        qk = _adjacent_heads(q, k)
        for x in (q, k) if qk is None else (qk,):
            x1 = x[..., :half].float()
            x2 = x[..., half:].float()
            # both halves are computed before either is written: x1/x2 may alias x
            o1 = x1 * cos - x2 * sin
            o2 = x2 * cos + x1 * sin
            x[..., :half].copy_(o1)
            x[..., half:].copy_(o2)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        i = x.shape[-1] // 2
        return F.silu(x[:, :i]) * x[:, i:]

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        hk, d = k_cache.shape[-2:]
        k_cache.view(-1, hk, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, hk, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    def paged_attention_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        block_size = k_cache.shape[1]
        flat, used = self._context_blocks(block_tables, seq_lens, block_size, "decode")

        def mask():
            key_pos = torch.arange(used * block_size, device=q.device)
            lens = seq_lens.to(torch.int64)[:, None]
            allowed = key_pos[None, :] < lens
            if sliding_window is not None:
                allowed &= key_pos[None, :] >= lens - sliding_window
            return allowed[:, None, None, :]

        allowed = self._per_step("decode_mask", (seq_lens, block_size, sliding_window), mask)
        keys, values = self._gather_blocks(k_cache, v_cache, flat, used, seq_lens.shape[0])
        # one query token per sequence: the query heads sharing a KV head are that head's "query rows"
        # ([B, Hk, Hq/Hk, D]), so K and V are read as they are instead of being expanded per query head
        batch, heads, dim = q.shape
        q_grouped = q.reshape(batch, keys.shape[1], heads // keys.shape[1], dim)
        out = _sdpa(q_grouped, keys, values, allowed, scale, softcap)
        return out.reshape(batch, heads, dim).to(q.dtype)

    def prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        sizes: tuple[int, int] | None = None,  # host tensors here: nothing to read back
        softcap: float | None = None,
    ) -> torch.Tensor:
        num_seqs = seq_lens.shape[0]
        block_size = k_cache.shape[1]
        flat, used = self._context_blocks(block_tables, seq_lens, block_size, "prefill")
        max_q, padded_at, allowed = self._per_step(
            "prefill_plan",  # q's row count and `used` follow from query_start_loc, seq_lens and block_size
            (query_start_loc, seq_lens, block_size, sliding_window),
            lambda: _prefill_plan(query_start_loc, seq_lens, q.shape[0], used * block_size, sliding_window),
        )
        if padded_at is None:
            q_pad = q[None]  # one sequence: no padding needed
        else:
            q_pad = q.new_zeros((num_seqs * max_q,) + tuple(q.shape[1:]))
            q_pad.index_copy_(0, padded_at, q)
            q_pad = q_pad.view((num_seqs, max_q) + tuple(q.shape[1:]))
        keys, values = self._gather_blocks(k_cache, v_cache, flat, used, num_seqs)
        out = _sdpa(q_pad.transpose(1, 2), keys, values, allowed, scale, softcap).transpose(1, 2)
        if padded_at is None:
            return out[0].to(q.dtype)
        return out.reshape((-1,) + tuple(out.shape[2:])).index_select(0, padded_at).to(q.dtype)

    def _context_blocks(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, kind: str
    ) -> tuple[torch.Tensor, int]:
        """The cache blocks to gather, row-major over [B, used] (int64), and `used` (blocks per sequence).

        `kind` keeps the decode and prefill sequences of one step apart in the per-step memo."""

        def build():
            used = -(-int(seq_lens.max()) // block_size)
            # index_select of whole blocks is a row copy, far faster than k_cache[table]
            return block_tables[:, :used].to(torch.int64).clamp(min=0).flatten(), used

        return self._per_step(f"{kind}_blocks", (block_tables, seq_lens, block_size), build)

    def _gather_blocks(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, flat: torch.Tensor, used: int, batch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the `flat` blocks as [B, Hk, used * block_size, D] views.

        The copies land in a workspace kept across calls: fresh multi-megabyte tensors at every layer
        cost more in page faults than the copy itself. The views are only valid until the next call.
        """
        block_size, hk, d = k_cache.shape[1:]
        n = flat.shape[0]
        ws = self._workspace(2 * n, k_cache)
        keys = torch.index_select(k_cache, 0, flat, out=ws[:n])
        values = torch.index_select(v_cache, 0, flat, out=ws[n : 2 * n])
        keys = keys.view(batch, used * block_size, hk, d).transpose(1, 2)
        values = values.view(batch, used * block_size, hk, d).transpose(1, 2)
        return keys, values

    def _workspace(self, blocks: int, like: torch.Tensor) -> torch.Tensor:
        """A [>= blocks, block_size, Hk, D] scratch tensor, grown geometrically, matching `like`."""
        ws = self._kv_workspace
        same_kind = (
            ws is not None
            and ws.shape[1:] == like.shape[1:]
            and ws.dtype == like.dtype
            and ws.device == like.device
            # an inference-mode tensor cannot be written outside inference mode, and vice versa
            and ws.is_inference() == torch.is_inference_mode_enabled()
        )
        if not (same_kind and ws.shape[0] >= blocks):
            # grow geometrically for a longer context; start afresh for another cache shape or dtype
            grown = max(blocks, 2 * ws.shape[0]) if same_kind else blocks
            ws = torch.empty((grown,) + tuple(like.shape[1:]), dtype=like.dtype, device=like.device)
            self._kv_workspace = ws
        return ws

    def lora_prepare(self, token_slots: torch.Tensor, num_slots: int) -> LoraMeta:
        """Plan the step's LoRA work once: long same-adapter runs as segments, the rest grouped by slot.

        A run of at least _SEGMENT_MIN consecutive tokens with one adapter (a prefill chunk, or decode
        tokens the runner sorted by slot) gets plain GEMMs on views of x and y, SGMV-style: no copies.
        The remaining adapter tokens are sorted by slot and padded into [G, M] groups for one bmm per
        slice (BGMV-style): gather [G * M] (token of each padded row; padding repeats a real token of
        the group, computed and then dropped), src / dest (token and padded row of each real entry),
        active_slots [G], groups G and width M; `padded` says whether any group is narrower than M,
        `span` gives (first, end) when src is the contiguous run first..end-1 (decode tokens sorted by
        slot), so that the deltas are added to a row slice of y instead of scattered.

        The plan is built with numpy on the host (a few dozen tiny ops: numpy's per-call cost is a
        fraction of torch's), then copied to the device once per tensor.
        """
        dev = token_slots.device
        slots = token_slots.to(device="cpu", dtype=torch.int64).numpy()
        adapter = slots >= 0
        if not adapter.any():
            return LoraMeta(token_slots, num_slots, empty=True, segments=[], grouped=None)
        total = slots.shape[0]
        starts = slot_runs(slots)
        ends = np.append(starts[1:], total)
        run_slot = slots[starts]
        long = (ends - starts >= _SEGMENT_MIN) & (run_slot >= 0)
        segments = list(zip(starts[long].tolist(), ends[long].tolist(), run_slot[long].tolist()))
        short = adapter & ~np.repeat(long, ends - starts)
        src = np.flatnonzero(short)
        grouped = None
        if src.size:
            src = src[np.argsort(slots[src], kind="stable")]
            # slots[src] is sorted: first occurrences are the group starts
            active_slots, group_start, counts = np.unique(slots[src], return_index=True, return_counts=True)
            groups, width = active_slots.shape[0], int(counts.max())
            group_of = np.repeat(np.arange(groups), counts)
            dest = group_of * width + (np.arange(src.shape[0]) - group_start[group_of])
            gather = np.repeat(src[group_start], width)
            gather[dest] = src
            first = int(src[0])
            in_order = bool(np.array_equal(src, np.arange(first, first + src.shape[0])))
            grouped = {
                "src": _on(src, dev),
                "dest": _on(dest, dev),
                "gather": _on(gather, dev),
                "active_slots": _on(active_slots, dev),
                "groups": groups,
                "width": width,
                # every group exactly `width` wide: the padded rows are the real rows, no gather/compaction
                "padded": bool((counts != width).any()),
                # src is first, first+1, ...: deltas land on contiguous rows y[first:first+len(src)]
                "span": (first, first + src.shape[0]) if in_order else None,
            }
        return LoraMeta(token_slots, num_slots, empty=False, segments=segments, grouped=grouped)

    def lora_shrink(self, x: torch.Tensor, a_stack: torch.Tensor, meta: LoraMeta) -> torch.Tensor:
        out_cols = a_stack.shape[1]
        h = x.new_zeros((x.shape[0], out_cols))
        ex = meta.extra
        if ex["empty"]:
            return h
        reduced = x.dtype in _REDUCED
        g = ex["grouped"]
        if g is not None:
            xg = x.index_select(0, g["gather"]).view(g["groups"], g["width"], x.shape[1])
            a = _select_slots(a_stack, g["active_slots"], meta.num_slots)
            if reduced:
                xg, a = xg.float(), a.float()
            hg = torch.bmm(xg, a.transpose(1, 2)).view(-1, out_cols)
            h.index_copy_(0, g["src"], hg.index_select(0, g["dest"]).to(h.dtype))
        for start, end, slot in ex["segments"]:
            if reduced:
                h[start:end] = (x[start:end].float() @ a_stack[slot].float().t()).to(h.dtype)
            else:
                torch.mm(x[start:end], a_stack[slot].t(), out=h[start:end])
        return h

    def lora_expand(
        self,
        h: torch.Tensor,
        b_stack: torch.Tensor,
        meta: LoraMeta,
        slice_offsets: tuple[int, ...],
        y: torch.Tensor,
    ) -> None:
        ex = meta.extra
        if ex["empty"]:
            return
        slice_offsets = _one_slice_if_block_diagonal(b_stack, h.shape[1], slice_offsets)
        n_slices = len(slice_offsets) - 1
        rank = h.shape[1] // n_slices
        reduced = h.dtype in _REDUCED or y.dtype in _REDUCED
        g = ex["grouped"]
        if g is not None:
            hg = h.index_select(0, g["gather"]).view(g["groups"], g["width"], h.shape[1])
            b = _select_slots(b_stack, g["active_slots"], meta.num_slots)
            if reduced:
                hg, b = hg.float(), b.float()
            yg = _cat_columns(_expand_slices(hg, b, slice_offsets, rank))
            self._scatter_add(y, slice_offsets, g["src"], yg.view(-1, yg.shape[-1]).index_select(0, g["dest"]))
        for start, end, slot in ex["segments"]:
            _add_segment_delta(h[start:end], b_stack[slot], slice_offsets, rank, y[start:end], reduced)

    def lora_apply(
        self,
        x: torch.Tensor,
        a_stack: torch.Tensor,
        b_stack: torch.Tensor,
        meta: LoraMeta,
        slice_offsets: tuple[int, ...],
        y: torch.Tensor,
    ) -> None:
        """shrink + expand fused: the grouped intermediate stays [G, M, n*R], never scattered to [T, n*R].

        At decode (tokens sorted by slot) this is one gather of x (none when the groups are equally
        wide), one bmm for A, one bmm per slice for B (one in all for a block-diagonal B, see LoraStack),
        and plain adds into a row slice of y.
        """
        ex = meta.extra
        if ex["empty"]:
            return
        slice_offsets = _one_slice_if_block_diagonal(b_stack, a_stack.shape[1], slice_offsets)
        n_slices = len(slice_offsets) - 1
        rank = a_stack.shape[1] // n_slices
        reduced = x.dtype in _REDUCED or y.dtype in _REDUCED
        # bf16 on a CPU with native bf16: oneDNN's bmm accumulates in fp32 and rounds h and the delta to bf16, as
        # PEFT's bf16 Linear layers do, without copying the adapter stacks to fp32 at every call
        native = reduced and _native_bf16(x, a_stack, b_stack, y)
        g = ex["grouped"]
        if g is not None:
            groups, width, span = g["groups"], g["width"], g["span"]
            if span is not None and not g["padded"]:
                xg = x[span[0] : span[1]].view(groups, width, x.shape[1])
            else:
                xg = x.index_select(0, g["gather"]).view(groups, width, x.shape[1])
            a = _select_slots(a_stack, g["active_slots"], meta.num_slots)
            b = _select_slots(b_stack, g["active_slots"], meta.num_slots)
            if reduced and not native:
                xg, a, b = xg.float(), a.float(), b.float()
            hg = torch.bmm(xg, a.transpose(1, 2))
            if reduced and not native:
                hg = hg.to(x.dtype).float()  # h rounded to the model dtype between A and B, as in lora_shrink and PEFT
            if span is not None:
                rows = y[span[0] : span[1]]
                for (lo, hi), d in zip(_bounds(slice_offsets), _expand_slices(hg, b, slice_offsets, rank)):
                    d = d.view(-1, hi - lo)
                    if g["padded"]:
                        d = d.index_select(0, g["dest"])
                    rows[:, lo:hi] += d.to(y.dtype)
            else:
                yg = _cat_columns(_expand_slices(hg, b, slice_offsets, rank))
                self._scatter_add(y, slice_offsets, g["src"], yg.view(-1, yg.shape[-1]).index_select(0, g["dest"]))
        if ex["segments"]:
            self._segments(x, a_stack, b_stack, ex["segments"], slice_offsets, y, rank, reduced and not native)

    @staticmethod
    def _scatter_add(y: torch.Tensor, slice_offsets: tuple[int, ...], src: torch.Tensor, delta: torch.Tensor) -> None:
        # index_add_ is fast over whole contiguous rows and very slow into a column slice
        whole = slice_offsets[0] == 0 and slice_offsets[-1] == y.shape[1]
        target = y if whole else y[:, slice_offsets[0] : slice_offsets[-1]]
        target.index_add_(0, src, delta.to(y.dtype))

    @staticmethod
    def _segments(
        x: torch.Tensor,
        a_stack: torch.Tensor,
        b_stack: torch.Tensor,
        segments: list[tuple[int, int, int]],
        slice_offsets: tuple[int, ...],
        y: torch.Tensor,
        rank: int,
        reduced: bool,
    ) -> None:
        """Long same-adapter runs: plain GEMMs on row views of x and y (prefill chunks).

        `reduced`: x or y in a reduced dtype multiplied in fp32 (a CPU without native bf16); with native bf16 the
        products run in bf16 as they are (fp32 accumulation, h and the delta rounded to bf16, as in PEFT)."""
        for start, end, slot in segments:
            xs, a = x[start:end], a_stack[slot]
            h = (xs.float() @ a.float().t()).to(x.dtype).float() if reduced else xs @ a.t()
            _add_segment_delta(h, b_stack[slot], slice_offsets, rank, y[start:end], reduced)


def _prefill_plan(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, total: int, keys: int, sliding_window: int | None
) -> tuple[int, torch.Tensor | None, torch.Tensor]:
    """What prefill attention needs of the step's chunks, the same at every layer: the padded query
    width, where each real query row goes in the padded [P * max_q] layout (None for one sequence),
    and the mask [P, 1, max_q, keys] (True = attend)."""
    dev = query_start_loc.device
    num_seqs = seq_lens.shape[0]
    starts = query_start_loc.to(torch.int64)
    q_lens = starts[1:] - starts[:-1]
    lens = seq_lens.to(torch.int64)
    if num_seqs == 1:
        max_q, padded_at = total, None
    else:
        max_q = int(q_lens.max())
        row_of = torch.repeat_interleave(torch.arange(num_seqs, device=dev), q_lens, output_size=total)
        padded_at = row_of * max_q + torch.arange(total, device=dev) - starts[:-1][row_of]
    key_pos = torch.arange(keys, device=dev)
    # query i of sequence p sits at absolute position seq_len - q_len + i
    q_pos = (lens - q_lens)[:, None] + torch.arange(max_q, device=dev)[None, :]
    allowed = key_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        allowed &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    # padded query rows would see no key at all (NaN softmax): let them see key 0, then drop them
    padded = torch.arange(max_q, device=dev)[None, :] >= q_lens[:, None]
    allowed[:, :, 0] |= padded
    return max_q, padded_at, allowed[:, None, :, :]


def _on(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host numpy array as a tensor on `device` (shares memory on the CPU)."""
    return torch.from_numpy(a).to(device)


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [T, Hq, D] and k [T, Hk, D] as one [T, Hq + Hk, D] view when k's heads follow q's in memory
    (the q and k column blocks of one fused qkv output), so both rotate in one pass; else None."""
    if q.dtype != k.dtype or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.stride() != k.stride():
        return None
    if (
        q.stride(2) != 1
        or q.stride(1) != q.shape[2]
        or k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
    ):
        return None
    if k.storage_offset() != q.storage_offset() + q.shape[1] * q.shape[2]:
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())


def _bounds(slice_offsets: tuple[int, ...]) -> list[tuple[int, int]]:
    """(lo, hi) column range of each slice of a fused module."""
    return list(zip(slice_offsets[:-1], slice_offsets[1:]))


def _add_segment_delta(
    h: torch.Tensor, b: torch.Tensor, slice_offsets: tuple[int, ...], rank: int, y_rows: torch.Tensor, reduced: bool
) -> None:
    """One adapter's run of tokens: y_rows[:, slice m] += h[:, m-th rank block] @ b[slice m]^T (fp32 when reduced)."""
    for m, (lo, hi) in enumerate(_bounds(slice_offsets)):
        hs, bs = h[:, m * rank : (m + 1) * rank], b[lo:hi]
        if reduced:
            y_rows[:, lo:hi] += (hs.float() @ bs.float().t()).to(y_rows.dtype)
        else:
            y_rows[:, lo:hi].addmm_(hs, bs.t())


def _one_slice_if_block_diagonal(b_stack: torch.Tensor, n_rank: int, slice_offsets: tuple[int, ...]) -> tuple[int, ...]:
    """A block-diagonal B ([S, out_total, n*R], see loraledger.lora.device_slots.LoraStack) of a fused module is
    one slice of rank n*R: its delta is one product over all the module's columns instead of one per slice."""
    if len(slice_offsets) > 2 and b_stack.shape[-1] == n_rank:
        return (slice_offsets[0], slice_offsets[-1])
    return slice_offsets


def _native_bf16(*tensors: torch.Tensor) -> bool:
    """All bf16 on a CPU that multiplies bf16 natively (see cpu_features)."""
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors) and cpu_features.native_bf16()


def _expand_slices(hg: torch.Tensor, b: torch.Tensor, slice_offsets: tuple[int, ...], rank: int) -> list[torch.Tensor]:
    """[G, M, n*R] grouped h times each slice's B ([G, out_total, R]): one [G, M, width_m] tensor per slice."""
    return [
        torch.bmm(hg[:, :, m * rank : (m + 1) * rank], b[:, lo:hi].transpose(1, 2))
        for m, (lo, hi) in enumerate(_bounds(slice_offsets))
    ]


def _cat_columns(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _select_slots(stack: torch.Tensor, active_slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    if active_slots.shape[0] == stack.shape[0] == num_slots:
        return stack  # every slot active: the sorted unique slots are 0..S-1 already
    return stack.index_select(0, active_slots)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """q [B, Hq, Q, D], k/v [B, Hk, L, D], mask [B, 1, Q, L] bool (True = attend); softmax in fp32.

    With softcap c the scores are capped as c * tanh(s / c), which SDPA cannot do: computed in full then.
    """
    if q.dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    if softcap is not None:
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * (scale / softcap)) * softcap
        return torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
