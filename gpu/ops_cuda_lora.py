"""CudaOps' LoRA ops: the SGMV / BGMV shrink and expand kernels, the fused one-launch decode kernel, their tables."""

from __future__ import annotations

from itertools import pairwise

import torch

from loraledger.gpu import kernel_checks as checks
from loraledger.gpu import kernel_sources as ks
from loraledger.gpu.kernel_args import cdiv, i32, i64, ptr
from loraledger.gpu.kernel_launcher import KernelLauncher
from loraledger.gpu.ops import LoraMeta, Ops, slot_runs
from loraledger.gpu.transfer import to_device

LORA_KERNELS = ("auto", "bgmv", "sgmv", "fused")
_CLUSTERS = (9, 0)  # compute capability with thread block clusters (the fused decode LoRA kernel)


def lora_segments(token_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of consecutive tokens with the same slot: (seg_indptr [G+1], seg_slots [G]), int64 like the input."""
    tokens = token_slots.shape[0]
    if tokens == 0:
        return torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    starts = torch.from_numpy(slot_runs(token_slots.numpy()))
    return torch.cat((starts, torch.tensor([tokens]))), token_slots[starts].to(torch.int64)


def lora_tiles(seg_indptr: torch.Tensor, tile: int) -> torch.Tensor:
    """Cut each segment into tiles of at most `tile` tokens: tile_starts [num_tiles + 1] (an indptr over tokens)."""
    lengths = seg_indptr[1:] - seg_indptr[:-1]
    per_seg = (lengths + tile - 1) // tile
    total = int(per_seg.sum())
    seg_of_tile = torch.repeat_interleave(torch.arange(lengths.shape[0]), per_seg, output_size=total)
    first_tile = torch.cumsum(per_seg, 0) - per_seg
    within = torch.arange(total) - first_tile[seg_of_tile]
    starts = seg_indptr[:-1][seg_of_tile] + within * tile
    return torch.cat((starts, seg_indptr[-1:]))


class CudaLoraOps(Ops):
    """The LoRA ops of CudaOps (a base class of it: it launches through CudaOps' launcher)."""

    device: torch.device
    _launcher: KernelLauncher
    _lora_kernel: str
    _slice_offsets: dict[tuple[int, ...], torch.Tensor]

    def lora_prepare(self, token_slots: torch.Tensor, num_slots: int) -> LoraMeta:
        """token_slots on the device plus the SGMV tables, built on the host from one small copy.

        extra: seg_indptr [G+1] / seg_slots [G] (runs of one slot), tile_starts [num_tiles+1] (runs cut
        to at most SGMV_TILE tokens), num_tiles, any_adapter. A caller may add slot_ranks (int32 [S]
        on the device) with max_rank (the padded R): rank rows past a slot's own rank, which must be
        zero padding, are then skipped.
        """
        checks.check_lora_prepare(token_slots, num_slots)
        host = token_slots.to(device="cpu", dtype=torch.int64)  # the runner passes host slots: no read-back
        checks.check_lora_slot_values(host, num_slots)
        seg_indptr, seg_slots = lora_segments(host)
        tile_starts = lora_tiles(seg_indptr, ks.SGMV_TILE)
        # one upload for the slots and the three tables, queued behind the previous step's work
        tables = to_device(torch.cat((host, seg_indptr, seg_slots, tile_starts)).numpy(), torch.int32, self.device)
        tokens, n_seg, n_tiles = host.shape[0], seg_slots.shape[0], tile_starts.shape[0] - 1
        tables, slots_dev = tables[tokens:], tables[:tokens]
        return LoraMeta(
            slots_dev,
            num_slots,
            seg_indptr=tables[: n_seg + 1],
            seg_slots=tables[n_seg + 1 : 2 * n_seg + 1],
            tile_starts=tables[2 * n_seg + 1 :],
            num_tiles=n_tiles,
            any_adapter=bool((host >= 0).any()),
        )

    def lora_decode_meta(self, token_slots: torch.Tensor, num_slots: int) -> LoraMeta:
        """A BGMV-only meta for one token per sequence, built without reading the slots (no host sync).

        For CUDA-graph capture (gpu/cuda_graphs.py): the kernels are launched whatever the slots hold
        (any_adapter is True), so one captured graph serves every later mix of adapters and base rows;
        token_slots must be a device int32 [T] tensor whose values the caller keeps in [-1, num_slots).
        """
        checks.check_lora_prepare(token_slots, num_slots)
        checks.require_device("lora_decode_meta", "token_slots", token_slots, self.device)
        if token_slots.dtype != torch.int32 or not token_slots.is_contiguous():
            checks.fail("lora_decode_meta", "token_slots must be a contiguous int32 tensor")
        tokens = token_slots.shape[0]
        return LoraMeta(
            token_slots,
            num_slots,
            seg_indptr=None,
            seg_slots=None,
            tile_starts=None,
            num_tiles=tokens,
            any_adapter=True,
        )

    def _use_sgmv(self, meta: LoraMeta, sgmv_blocks: int) -> bool:
        """SGMV reuses each weight row across a tile: worth it when tiles are mostly full and still fill the GPU."""
        if meta.extra["tile_starts"] is None:
            return False  # a decode meta (lora_decode_meta) has no tile table: BGMV only
        if self._lora_kernel != "auto":
            return self._lora_kernel == "sgmv"
        tokens, tiles = meta.token_slots.shape[0], meta.extra["num_tiles"]
        return tokens >= 4 * tiles and sgmv_blocks >= 2 * self._launcher.sm_count

    def _use_fused(self, meta: LoraMeta, rows: int) -> bool:
        """The fused kernel serves the BGMV case (one token per cluster) on GPUs with clusters."""
        if self._lora_kernel in ("bgmv", "sgmv"):
            return False
        if self._launcher.compute_capability < _CLUSTERS:
            if self._lora_kernel == "fused":
                checks.fail(
                    "lora_apply",
                    f"the fused LoRA kernel needs compute capability 9.0, this GPU has {self._launcher.compute_capability}",
                )
            return False
        if self._lora_kernel == "fused":
            return True
        return not self._use_sgmv(meta, meta.extra["num_tiles"] * cdiv(rows, ks.SGMV_SHRINK_ROWS))

    def lora_apply(
        self,
        x: torch.Tensor,
        a_stack: torch.Tensor,
        b_stack: torch.Tensor,
        meta: LoraMeta,
        slice_offsets: tuple[int, ...],
        y: torch.Tensor,
    ) -> None:
        """y += LoRA delta: one fused launch where _use_fused says so, else lora_shrink then lora_expand.

        The fused kernel keeps h in fp32 between its halves (the composition rounds it to x's dtype).
        """
        tokens = meta.token_slots.shape[0]
        offsets = tuple(int(o) for o in slice_offsets)
        op = "lora_apply"
        checks.check_lora_shrink(x, a_stack, tokens, meta.num_slots)
        rows = a_stack.shape[1]
        if not self._use_fused(meta, rows):
            super().lora_apply(x, a_stack, b_stack, meta, offsets, y)
            return
        n_slices = len(offsets) - 1
        checks.check_lora_delta_target(op, b_stack, offsets, y, tokens, meta.num_slots, rows, "a_stack.shape[1]")
        checks.require_device(op, "x", x, self.device)
        checks.require_device(op, "y", y, self.device)
        ranks, rank = self._lora_tables(op, meta, rows)
        if ranks is None:
            rank = rows // n_slices
        elif rank * n_slices != rows:
            checks.fail(op, f"meta.extra['max_rank'] ({rank}) * n_slices ({n_slices}) != a_stack.shape[1] ({rows})")
        k, out_total = x.shape[1], offsets[-1]
        if tokens == 0 or rows == 0 or k == 0 or out_total == 0 or not meta.extra["any_adapter"]:
            return
        vec = 16 // x.element_size()
        cluster = ks.LORA_FUSED_CLUSTER
        k_slice = cdiv(cdiv(k, cluster), vec) * vec
        packed = int(k % vec == 0 and a_stack.data_ptr() % 16 == 0)  # x is staged through shared memory
        packed |= 2 * int(rank % vec == 0 and b_stack.data_ptr() % 16 == 0)
        smem = (k_slice + 2 * rows) * 4
        args = (
            ptr(y),
            i64(y.stride(0)),
            ptr(x),
            i64(x.stride(0)),
            ptr(a_stack),
            ptr(b_stack),
            ptr(meta.token_slots),
            ptr(ranks),
            ptr(self._device_offsets(offsets)),
            i32(k),
            i32(rows),
            i32(rank),
            i32(n_slices),
            i32(out_total),
            i32(k_slice),
            i32(cdiv(out_total, cluster)),
            i32(packed),
        )
        self._launcher.launch(
            ks.LORA_BGMV_FUSED,
            (ks.ELEMENT_TYPES[x.dtype],),
            (tokens * cluster,),
            ks.LORA_FUSED_THREADS,
            args,
            shared_mem=smem,
        )

    def _lora_tables(self, op: str, meta: LoraMeta, rows: int) -> tuple[torch.Tensor | None, int]:
        """Checks that meta came from this backend's lora_prepare; returns (slot_ranks or None, padded rank R)."""
        if "tile_starts" not in meta.extra:
            checks.fail(op, "meta must come from CudaOps.lora_prepare (it lacks the SGMV tile table)")
        checks.require_device(op, "meta.token_slots", meta.token_slots, self.device)
        ranks = meta.extra.get("slot_ranks")
        if ranks is None:
            return None, rows
        max_rank = meta.extra.get("max_rank")
        checks.check_slot_ranks(op, ranks, max_rank, meta.num_slots, rows)
        checks.require_device(op, "meta.extra['slot_ranks']", ranks, self.device)
        return ranks, int(max_rank)

    def lora_shrink(self, x: torch.Tensor, a_stack: torch.Tensor, meta: LoraMeta) -> torch.Tensor:
        tokens = meta.token_slots.shape[0]
        checks.check_lora_shrink(x, a_stack, tokens, meta.num_slots)
        checks.require_device("lora_shrink", "x", x, self.device)
        rows, k = a_stack.shape[1], x.shape[1]
        ranks, rank = self._lora_tables("lora_shrink", meta, rows)
        if tokens == 0 or rows == 0 or k == 0 or not meta.extra["any_adapter"]:
            return torch.zeros((tokens, rows), dtype=x.dtype, device=x.device)
        h = torch.empty((tokens, rows), dtype=x.dtype, device=x.device)
        tiles = meta.extra["num_tiles"]
        ctype = ks.ELEMENT_TYPES[x.dtype]
        if self._use_sgmv(meta, tiles * cdiv(rows, ks.SGMV_SHRINK_ROWS)):
            targs, grid = (ctype, ks.SGMV_TILE, ks.SGMV_SHRINK_ROWS), (tiles, cdiv(rows, ks.SGMV_SHRINK_ROWS))
            tile_starts = meta.extra["tile_starts"]
        else:
            targs, grid = (ctype, 1, ks.BGMV_SHRINK_ROWS), (tokens, cdiv(rows, ks.BGMV_SHRINK_ROWS))
            tile_starts = None
        args = (
            ptr(h),
            ptr(x),
            i64(x.stride(0)),
            ptr(a_stack),
            ptr(meta.token_slots),
            ptr(tile_starts),
            ptr(ranks),
            i32(tokens),
            i32(k),
            i32(rows),
            i32(rank),
        )
        self._launcher.launch(ks.LORA_SHRINK, targs, grid, ks.LORA_SHRINK_THREADS, args)
        return h

    def _device_offsets(self, offsets: tuple[int, ...]) -> torch.Tensor:
        """slice_offsets as a device array, uploaded once per distinct tuple (one per fused module)."""
        cached = self._slice_offsets.get(offsets)
        if cached is None:
            cached = torch.tensor(offsets, dtype=torch.int32, device=self.device)
            self._slice_offsets[offsets] = cached
        return cached

    def lora_expand(
        self,
        h: torch.Tensor,
        b_stack: torch.Tensor,
        meta: LoraMeta,
        slice_offsets: tuple[int, ...],
        y: torch.Tensor,
    ) -> None:
        tokens = meta.token_slots.shape[0]
        offsets = tuple(int(o) for o in slice_offsets)
        checks.check_lora_expand(h, b_stack, offsets, y, tokens, meta.num_slots)
        checks.require_device("lora_expand", "y", y, self.device)
        n_slices = len(offsets) - 1
        ranks, rank = self._lora_tables("lora_expand", meta, h.shape[1])
        if ranks is None:
            rank = h.shape[1] // n_slices
        elif rank * n_slices != h.shape[1]:
            checks.fail(
                "lora_expand", f"meta.extra['max_rank'] ({rank}) * n_slices ({n_slices}) != h.shape[1] ({h.shape[1]})"
            )
        widest = max(b - a for a, b in pairwise(offsets))
        if tokens == 0 or widest == 0 or not meta.extra["any_adapter"]:
            return
        tiles = meta.extra["num_tiles"]
        col_blocks = cdiv(widest, ks.LORA_EXPAND_THREADS)
        if self._use_sgmv(meta, tiles * col_blocks * n_slices):
            toks, grid, tile_starts = ks.SGMV_TILE, (tiles, col_blocks, n_slices), meta.extra["tile_starts"]
        else:
            toks, grid, tile_starts = 1, (tokens, col_blocks, n_slices), None
        args = (
            ptr(y),
            i64(y.stride(0)),
            ptr(h),
            ptr(b_stack),
            ptr(meta.token_slots),
            ptr(tile_starts),
            ptr(ranks),
            ptr(self._device_offsets(offsets)),
            i32(tokens),
            i32(n_slices),
            i32(rank),
            i32(offsets[-1]),
        )
        targs = (ks.ELEMENT_TYPES[y.dtype], toks)
        self._launcher.launch(ks.LORA_EXPAND, targs, grid, ks.LORA_EXPAND_THREADS, args, shared_mem=toks * rank * 4)
