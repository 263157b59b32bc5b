"""TorchLoraOps: TorchOps' batched multi-LoRA delta in plain torch (plan, shrink, expand, both fused), for TorchOps."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from loraledger.gpu import cpu_features, kernel_checks, lora_cpu_kernel
from loraledger.gpu.ops import LoraMeta, Ops, slot_runs
from loraledger.lora.device_slots import slot_dtype

_REDUCED = (torch.bfloat16, torch.float16)
# a run of at least this many same-adapter tokens gets its own GEMMs instead of the grouped bmm
_SEGMENT_MIN = 16


class TorchLoraOps(Ops):
    def lora_b_layout(self, model_dtype: torch.dtype, device: torch.device) -> str:
        """Rank-major B where the CPU kernel runs (gpu/lora_cpu_kernel.py: a dtype it has, the slots
        in the model's dtype); elsewhere block-diagonal: one expand product per fused module instead of one per
        slice, fewer small ops where each costs microseconds."""
        device = torch.device(device)
        if device.type == "cpu" and slot_dtype(model_dtype, device) == model_dtype:
            kernel = lora_cpu_kernel.load()
            if kernel is not None and kernel.supports(model_dtype):
                return "rank_major"
        return "block_diagonal"

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
        kernel_checks.check_lora_slot_values(torch.from_numpy(slots), num_slots)  # they index the adapter stacks
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
                # each group's first entry in src, and src's length: the CPU kernel's group table; the rows and
                # slots it indexes, checked before it runs
                "bounds": _on(np.append(group_start, src.shape[0]).astype(np.int64), dev),
                "rows": total,
                "host": dev.type == "cpu",  # the group table's tensors are host memory the CPU kernel can read
                "slot_min": int(active_slots[0]),
                "slot_max": int(active_slots[-1]),
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
            xg, a = _grouped_operands(x, a_stack, g, meta.num_slots, reduced)
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
        slice_offsets, rank = _expand_slicing(b_stack, h.shape[1], slice_offsets)
        reduced = h.dtype in _REDUCED or y.dtype in _REDUCED
        g = ex["grouped"]
        if g is not None:
            hg, b = _grouped_operands(h, b_stack, g, meta.num_slots, reduced)
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
        g = ex["grouped"]
        stacks = None if g is None else self._kernel_for(x, a_stack, b_stack, y, slice_offsets, g)
        if stacks is not None:
            self._kernel_grouped(stacks, x, meta, g, y)
            if not ex["segments"]:
                return  # a decode step's call: nothing else to do, and nothing more to check
            g = None
        slice_offsets, rank = _expand_slicing(b_stack, a_stack.shape[1], slice_offsets)
        reduced = x.dtype in _REDUCED or y.dtype in _REDUCED
        # bf16 on a CPU with native bf16: oneDNN's bmm accumulates in fp32 and rounds h and the delta to bf16, as
        # PEFT's bf16 Linear layers do, without copying the adapter stacks to fp32 at every call
        native = reduced and _native_bf16(x, a_stack, b_stack, y)
        if g is not None:
            with _one_thread():
                self._grouped(x, a_stack, b_stack, meta, g, slice_offsets, y, rank, reduced, native)
        if ex["segments"]:
            self._runs(x, a_stack, b_stack, meta, slice_offsets, y, rank, reduced, native)

    def _runs(
        self,
        x: torch.Tensor,
        a_stack: torch.Tensor,
        b_stack: torch.Tensor,
        meta: LoraMeta,
        slice_offsets: tuple[int, ...],
        y: torch.Tensor,
        rank: int,
        reduced: bool,
        native: bool,
    ) -> None:
        """The plan's long same-adapter runs (prefill chunks): the CPU kernel takes those up to its run limit
        (LoraCpuKernel.run_limit: 96 or 256 tokens in fp32 by the CPU's vectors; every run of bf16 that the CPU
        emulates, where torch would multiply fp32 copies of every run's rows and stacks: 1,985 prefill tokens, 8
        adapters, one fused qkv, 54 ms against the kernel's 9.6; 256 tokens of native bf16 with AVX512-BF16, none
        with AMX), torch's GEMMs the rest (oneDNN's bf16 GEMMs with native bf16)."""
        ex = meta.extra
        kernel = lora_cpu_kernel.load() if x.device.type == "cpu" else None
        limit = 0 if kernel is None else kernel.run_limit(x.dtype, native)
        groups, rest = _kernel_runs(ex, limit)
        stacks = None if groups is None else self._kernel_for(x, a_stack, b_stack, y, slice_offsets, groups)
        if stacks is not None:
            self._kernel_grouped(stacks, x, meta, groups, y)
        else:
            rest = ex["segments"]
        if rest:
            self._segments(x, a_stack, b_stack, rest, slice_offsets, y, rank, reduced and not native)

    def _grouped(
        self,
        x: torch.Tensor,
        a_stack: torch.Tensor,
        b_stack: torch.Tensor,
        meta: LoraMeta,
        g: dict,
        slice_offsets: tuple[int, ...],
        y: torch.Tensor,
        rank: int,
        reduced: bool,
        native: bool,
    ) -> None:
        """The grouped tokens (decode): one gather of x, one bmm for A, one per slice for B, adds into y."""
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

    def _kernel_for(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        y: torch.Tensor,
        slice_offsets: tuple[int, ...],
        g: dict,
    ) -> lora_cpu_kernel.BoundStacks | None:
        """The stacks bound to the CPU kernel, where it takes these operands: one dtype it has, all on the CPU, A
        [S, n*R, in] contiguous, B the rank-major view [S, out, R] (LoraSlots' "rank_major" layout), rows of x and
        y with unit column stride, the group table in host memory, and every index it reads without bounds in range
        (token rows, slots, slice columns); None otherwise (the torch path runs). The stacks' part is checked once
        (_stack_kernel), x's and y's at every call, from the fewest tensor attributes: a decode step makes 32 of
        these calls."""
        stacks = self._stack_kernel(a, b, slice_offsets)
        if stacks is None:
            return None
        xs, ys, dtype = x.shape, y.shape, stacks.dtype
        fits = (
            x.is_cpu
            and y.is_cpu
            and x.dtype == dtype
            and y.dtype == dtype
            and len(xs) == 2
            and len(ys) == 2
            and x.stride(1) == 1
            and y.stride(1) == 1
            and xs[1] == stacks.in_features
            and ys[1] == stacks.out_total
            and g.get("host", False)
            and g["rows"] <= min(xs[0], ys[0])
            and 0 <= g["slot_min"]
            and g["slot_max"] < stacks.slots
        )
        return stacks if fits else None

    def _stack_kernel(
        self, a: torch.Tensor, b: torch.Tensor, slice_offsets: tuple[int, ...]
    ) -> lora_cpu_kernel.BoundStacks | None:
        """_kernel_for's checks of one module's stacks (A, B and its slice offsets), and their binding to the
        kernel, made once per pair of stack views: LoraSlots hands out the same views of a layer's stacks at every
        step (written in place, never reshaped), and 16 checks per call were ~40% of a decode call's time outside
        the kernel. Keyed on the views, their storage, shapes and strides (a view changed in place, by transpose_
        or as_strided_, is checked anew), holding them so that a key is never reused; cleared past 4,096 pairs."""
        cache = self.__dict__.setdefault("_lora_stack_kernels", {})
        key = (id(a), id(b), a.data_ptr(), b.data_ptr(), a.shape, a.stride(), b.shape, b.stride(), slice_offsets)
        hit = cache.get(key)
        if hit is not None and hit[0] is a and hit[1] is b:
            return hit[2]
        if len(cache) >= 4096:
            cache.clear()
        kernel = lora_cpu_kernel.load() if a.device.type == b.device.type == "cpu" else None
        offsets = self._offsets_tensor(slice_offsets)
        fits = (
            kernel is not None
            and kernel.supports(a.dtype)
            and a.dtype == b.dtype
            and a.dim() == b.dim() == 3
            and a.is_contiguous()
            and _strides_are(b, (b.shape[1] * b.shape[2], 1, b.shape[1]))
            and a.shape[0] == b.shape[0]
            and a.shape[1] == (len(slice_offsets) - 1) * b.shape[2]
            and offsets is not None
            and slice_offsets[-1] <= b.shape[1]
        )
        entry = cache[key] = (a, b, kernel.bind(a, b, offsets) if fits else None)
        return entry[2]

    def _kernel_grouped(
        self, stacks: lora_cpu_kernel.BoundStacks, x: torch.Tensor, meta: LoraMeta, g: dict, y: torch.Tensor
    ) -> None:
        """The grouped tokens through the CPU kernel: one call, no intermediate tensors (gpu/lora_cpu_kernel.py).
        The group table's pointers are taken once per plan, for the step's every module."""
        ranks = meta.extra.get("slot_ranks")
        held = (stacks.slots, ranks.data_ptr(), ranks.shape) if isinstance(ranks, torch.Tensor) else (stacks.slots,)
        plan = g.get("kernel_plan")
        # made anew where another ranks tensor, or the same one moved or resized, is in the plan now: the kernel
        # must never read a pointer the plan took from a tensor since freed (the plan holds the one it took)
        if plan is None or plan[0] is not ranks or plan[1] != held:
            plan = g["kernel_plan"] = (ranks, held, self._group_plan(ranks, g, stacks.slots))
        # a few KiB, the plan's own: one step's calls run one after another, and two threads on one TorchOps run
        # two plans (the kernel runs without the GIL, so they must not share it)
        scratch = g.get("scratch")
        if scratch is None or scratch.shape[0] < stacks.scratch_floats:
            scratch = g["scratch"] = torch.empty(stacks.scratch_floats, dtype=torch.float32)
        stacks.kernel.run(stacks, x, y, plan[2], scratch)

    @staticmethod
    def _group_plan(ranks: object, g: dict, slots: int) -> tuple:
        """The group table as the kernel's pointers, with the slots' ranks (the plan's "slot_ranks",
        LoraSlots.rank_table(): each slot's rank, rows past it are zero) where the kernel can index them."""
        usable = (
            isinstance(ranks, torch.Tensor)
            and ranks.dtype == torch.int32
            and ranks.shape == (slots,)
            and ranks.device.type == "cpu"
            and ranks.is_contiguous()
        )
        return lora_cpu_kernel.group_plan(ranks if usable else None, g["active_slots"], g["bounds"], g["src"])

    def _offsets_tensor(self, slice_offsets: tuple[int, ...]) -> torch.Tensor | None:
        """A fused module's slice offsets as the kernel's int64 tensor, made and checked once per module shape
        (non-negative and non-decreasing, else None: the kernel is not given them)."""
        cache = self.__dict__.setdefault("_lora_offsets", {})
        if slice_offsets not in cache:
            ordered = slice_offsets[0] >= 0 and all(lo <= hi for lo, hi in zip(slice_offsets, slice_offsets[1:]))
            cache[slice_offsets] = torch.tensor(slice_offsets, dtype=torch.int64) if ordered else None
        return cache[slice_offsets]

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


def _strides_are(t: torch.Tensor, strides: tuple[int, ...]) -> bool:
    """t's strides are these, where they matter (a dimension of size 1 may have any stride)."""
    return all(n == 1 or have == want for n, have, want in zip(t.shape, t.stride(), strides))


def _on(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host numpy array as a tensor on `device` (shares memory on the CPU)."""
    return torch.from_numpy(a).to(device)


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


@contextlib.contextmanager
def _one_thread():
    """Run the enclosed torch ops on one intra-op thread, then restore the count.

    The grouped LoRA products are a few rows each: a second thread gains ~10% on an idle machine, and on a
    shared one each product waits at its barrier until the other thread is scheduled again (a [6, 4, 512] x
    [6, 512, 48] bf16 bmm: 44-57 us on 1 thread, 0.8-2.2 ms on 2 at load 4). Setting the count costs < 1 us.
    """
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _expand_slicing(b_stack: torch.Tensor, n_rank: int, slice_offsets: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """The slices the expand multiplies, and the rank of each, for an intermediate h of n_rank columns.

    A block-diagonal B ([S, out_total, n*R], see loraledger.lora.device_slots.LoraStack) of a fused module is one
    slice of rank n*R: its delta is one product over all the module's columns instead of one per slice."""
    if len(slice_offsets) > 2 and b_stack.shape[-1] == n_rank:
        slice_offsets = (slice_offsets[0], slice_offsets[-1])
    return slice_offsets, n_rank // (len(slice_offsets) - 1)


def _native_bf16(*tensors: torch.Tensor) -> bool:
    """All bf16 on a CPU that multiplies bf16 natively (see cpu_features)."""
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors) and cpu_features.native_bf16()


def _expand_slices(hg: torch.Tensor, b: torch.Tensor, slice_offsets: tuple[int, ...], rank: int) -> list[torch.Tensor]:
    """[G, M, n*R] grouped h times each slice's B ([G, out_total, R]): one [G, M, width_m] tensor per slice."""
    return [
        torch.bmm(hg[:, :, m * rank : (m + 1) * rank], b[:, lo:hi].transpose(1, 2))
        for m, (lo, hi) in enumerate(_bounds(slice_offsets))
    ]


def _kernel_runs(extra: dict, limit: int | None) -> tuple[dict | None, list[tuple[int, int, int]]]:
    """The plan's runs (start, end, slot) the CPU kernel takes, as its group table (see lora_prepare's grouped
    dict: a group per run, its tokens start..end-1; None when there are none), and the runs left to torch: those
    of at most `limit` tokens to the kernel (every run where None). Made by the first module of a step that needs
    it and kept in the plan for the step's other modules."""
    key = ("kernel_runs", limit)
    if key not in extra:
        runs = extra["segments"]
        short = [r for r in runs if limit is None or r[1] - r[0] <= limit]
        extra[key] = (_as_groups(short), [r for r in runs if limit is not None and r[1] - r[0] > limit])
    return extra[key]


def _as_groups(segments: list[tuple[int, int, int]]) -> dict | None:
    """Runs (start, end, slot) as the CPU kernel's group table (see lora_prepare's grouped dict): a group per
    run, its tokens start..end-1; None without runs."""
    if not segments:
        return None
    starts, ends, slots = (np.array(column, dtype=np.int64) for column in zip(*segments))
    tokens = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in zip(starts, ends)])
    return {
        "active_slots": torch.from_numpy(slots),
        "bounds": torch.from_numpy(np.append(0, np.cumsum(ends - starts))),
        "src": torch.from_numpy(tokens),
        "rows": int(ends.max()),
        "host": True,
        "slot_min": int(slots.min()),
        "slot_max": int(slots.max()),
    }


def _cat_columns(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _grouped_operands(
    rows: torch.Tensor, stack: torch.Tensor, g: dict, num_slots: int, reduced: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped tokens' rows as [G, M, cols] (padded rows repeat a real one) and their slots' stacks, in fp32
    where `reduced` (lora_shrink / lora_expand's grouped part)."""
    grouped = rows.index_select(0, g["gather"]).view(g["groups"], g["width"], rows.shape[1])
    stacks = _select_slots(stack, g["active_slots"], num_slots)
    return (grouped.float(), stacks.float()) if reduced else (grouped, stacks)


def _select_slots(stack: torch.Tensor, active_slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    if active_slots.shape[0] == stack.shape[0] == num_slots:
        return stack  # every slot active: the sorted unique slots are 0..S-1 already
    return stack.index_select(0, active_slots)
