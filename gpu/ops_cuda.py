"""CudaOps: the device ops as CuPy RawKernels (gpu/kernels/*.cu) launched on torch's current CUDA stream.

Tensors reach the kernels without copies: each launch passes `tensor.data_ptr()` and sizes as
typed scalars, after the pure checks of kernel_checks.py have vouched for shapes, strides,
dtypes and devices. CuPy is imported only when a CudaOps is built.

Prefill attention is the one op without a kernel of its own: it gathers each sequence's cached
context and calls torch's scaled_dot_product_attention, whose fused CUDA kernels already run
causal attention near peak; what needed custom kernels is the decode path, where the context is
paged and each sequence brings one query.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import torch
import torch.nn.functional as F

from loraledger.errors import ConfigError, DeviceError, InternalError
from loraledger.gpu import kernel_checks as checks
from loraledger.gpu import kernel_sources as ks
from loraledger.gpu.backend import require_cuda
from loraledger.gpu.kernel_launcher import CupyLauncher, KernelLauncher
from loraledger.gpu.ops import LoraMeta, Ops, StepMemo, slot_runs
from loraledger.gpu.ops_quant import QuantLinearOps
from loraledger.gpu.transfer import to_device

_LOG2E = 1.4426950408889634
_GRID_STRIDE_BLOCKS = 65535  # grid-stride kernels never need more blocks than this
SPLIT_MIN = 1024  # the shortest context span worth its own paged-attention block (H100 sweep: 256 -> 1024 took U = 2 from 51 % to 55 % of copy bandwidth)
_MAX_SPLITS = 1024  # the reduce kernel keeps one fp32 weight per split in shared memory
LORA_KERNELS = ("auto", "bgmv", "sgmv", "fused")
_CLUSTERS = (9, 0)  # compute capability with thread block clusters (the fused decode LoRA kernel)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _i32(v: int) -> np.int32:
    return np.int32(v)


def _i64(v: int) -> np.int64:
    return np.int64(v)


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


def prefill_sizes(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> tuple[int, int]:
    """(longest query chunk, longest context) of a prefill batch: one small read-back from the device."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    max_q, max_len = torch.stack((q_lens.max(), seq_lens.max())).to(torch.int64).tolist()
    return int(max_q), int(max_len)


def sdpa_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sizes: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Ops.prefill_attention by gathering each sequence's context and calling torch SDPA.

    GQA heads are expanded by repeat_interleave so that the fused memory-efficient kernel applies
    with a boolean mask. bf16/fp16 inputs are attended in fp32, like the TorchOps twin: on an H100
    the engine's bf16 prompt logprobs on the test fixture were 5.0e-2 off the fp32 reference with
    half-precision SDPA and 3.6e-2 with this (transformers' own bf16 forward: 4.6e-2).

    sizes: (longest query chunk, longest context) when the caller knows them; otherwise they are
    read back from the device (a host sync).
    """
    seqs = seq_lens.shape[0]
    tq, hq, d = q.shape
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    if tq == 0 or seqs == 0:
        return q.new_empty((0, hq, d))
    starts = query_start_loc.to(torch.int64)
    q_lens = starts[1:] - starts[:-1]
    lens = seq_lens.to(torch.int64)
    max_q, max_len = prefill_sizes(query_start_loc, seq_lens) if sizes is None else sizes
    used = _cdiv(max(max_len, 1), block_size)
    table = block_tables[:, :used].to(torch.int64).clamp(min=0)
    keys = k_cache[table].view(seqs, used * block_size, hk, d).transpose(1, 2)
    values = v_cache[table].view(seqs, used * block_size, hk, d).transpose(1, 2)
    if hq != hk:
        keys = keys.repeat_interleave(hq // hk, dim=1)
        values = values.repeat_interleave(hq // hk, dim=1)
    seq_of = torch.repeat_interleave(torch.arange(seqs, device=q.device), q_lens, output_size=tq)
    col = torch.arange(tq, device=q.device) - starts[:-1][seq_of]
    q_pad = q.new_zeros((seqs, max_q, hq, d))
    q_pad[seq_of, col] = q
    # query i of sequence p sits at absolute position seq_len - q_len + i
    q_pos = (lens - q_lens)[:, None] + torch.arange(max_q, device=q.device)[None, :]
    key_pos = torch.arange(used * block_size, device=q.device)
    allowed = key_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        allowed &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    # padded query rows would see no key (NaN softmax): let them see key 0; they are dropped below
    allowed[:, :, 0] |= torch.arange(max_q, device=q.device)[None, :] >= q_lens[:, None]
    q_t = q_pad.transpose(1, 2)
    if q.dtype != torch.float32:
        q_t, keys, values = q_t.float(), keys.float(), values.float()
    out = F.scaled_dot_product_attention(q_t, keys, values, attn_mask=allowed[:, None, :, :], scale=scale)
    return out.transpose(1, 2)[seq_of, col].to(q.dtype)


class CudaOps(QuantLinearOps, Ops):
    name = "cuda"

    def __init__(
        self, device: torch.device | str = "cuda", *, lora_kernel: str = "auto", launcher: KernelLauncher | None = None
    ) -> None:
        """lora_kernel: "auto" picks per call: SGMV for long same-adapter runs, else the fused one-launch
        BGMV on GPUs with thread block clusters (compute capability 9.0), else BGMV shrink then expand;
        "bgmv" / "sgmv" / "fused" force one (tests, benchmarks).

        launcher: None runs the kernels with CuPy on the CUDA device; anything else is used as given
        (the tests pass a CPU emulation of the kernels, with CPU tensors).
        """
        if lora_kernel not in LORA_KERNELS:
            raise ConfigError(f"lora_kernel must be one of {LORA_KERNELS}, got {lora_kernel!r}")
        dev = torch.device(device)
        if launcher is None:
            require_cuda()
            if dev.type != "cuda":
                raise DeviceError(f"CudaOps needs a CUDA device, got {str(dev)!r}; use TorchOps for the CPU")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            launcher = CupyLauncher(dev)
        self.device = dev
        self._lora_kernel = lora_kernel
        self._launcher = launcher
        self._slice_offsets: dict[tuple[int, ...], torch.Tensor] = {}
        self._step_memo = StepMemo()  # eager steps only: graph steps never reach prefill_attention

    @property
    def compute_capability(self) -> tuple[int, int]:
        """The device's (major, minor) compute capability, as the kernels are built for it."""
        return self._launcher.compute_capability

    def _on_device(self, op: str, name: str, t: torch.Tensor) -> None:
        checks.require_device(op, name, t, self.device)

    # ---- small fused ops ----

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        checks.check_rms_norm(x, weight, residual)
        self._on_device("rms_norm", "x", x)
        tokens, hidden = x.shape
        out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
        r_out = None if residual is None else torch.empty_like(out)
        if tokens and hidden:
            vec = 16 // x.element_size()
            threads = min(1024, max(32, _cdiv(_cdiv(hidden, vec), 32) * 32))
            args = (
                _ptr(out),
                _ptr(r_out),
                _ptr(x),
                _i64(x.stride(0)),
                _ptr(residual),
                _i64(0 if residual is None else residual.stride(0)),
                _ptr(weight),
                _i32(tokens),
                _i32(hidden),
                np.float32(eps),
            )
            grid = (min(tokens, _GRID_STRIDE_BLOCKS),)
            self._launcher.launch(ks.RMS_NORM, (ks.ELEMENT_TYPES[x.dtype],), grid, threads, args)
        return out, (x if r_out is None else r_out)

    def rotary_embedding(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> None:
        checks.check_rotary_embedding(positions, q, k, cos_sin_cache)
        self._on_device("rotary_embedding", "q", q)
        tokens, hq, d = q.shape
        hk = k.shape[1]
        if tokens == 0 or d == 0:
            return
        threads = min(512, _cdiv((hq + hk) * (d // 2), 32) * 32)
        args = (
            _ptr(q),
            _i64(q.stride(0)),
            _ptr(k),
            _i64(k.stride(0)),
            _ptr(positions),
            _ptr(cos_sin_cache),
            _i32(tokens),
            _i32(hq),
            _i32(hk),
            _i32(d),
            _i64(cos_sin_cache.shape[0]),
        )
        targs = (ks.ELEMENT_TYPES[q.dtype], ks.INDEX_TYPES[positions.dtype])
        self._launcher.launch(ks.ROTARY_EMBEDDING, targs, (min(tokens, _GRID_STRIDE_BLOCKS),), threads, args)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        checks.check_silu_and_mul(x)
        self._on_device("silu_and_mul", "x", x)
        tokens, inter = x.shape[0], x.shape[1] // 2
        out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
        if tokens and inter:
            threads = 256
            blocks = min(_cdiv(tokens * inter, threads), _GRID_STRIDE_BLOCKS)
            args = (_ptr(out), _ptr(x), _i64(x.stride(0)), _i32(tokens), _i32(inter))
            self._launcher.launch(ks.SILU_AND_MUL, (ks.ELEMENT_TYPES[x.dtype],), (blocks,), threads, args)
        return out

    # ---- KV cache and attention ----

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        checks.check_write_kv(key, value, k_cache, v_cache, slot_mapping)
        self._on_device("write_kv", "k_cache", k_cache)
        tokens = key.shape[0]
        row = k_cache.shape[2] * k_cache.shape[3]
        if tokens == 0 or row == 0:
            return
        vec = 16 // key.element_size()
        threads = min(256, max(32, _cdiv(_cdiv(row, vec), 32) * 32))
        args = (
            _ptr(k_cache),
            _ptr(v_cache),
            _ptr(key),
            _i64(key.stride(0)),
            _ptr(value),
            _i64(value.stride(0)),
            _ptr(slot_mapping),
            _i32(tokens),
            _i32(row),
        )
        targs = (ks.ELEMENT_TYPES[key.dtype], ks.INDEX_TYPES[slot_mapping.dtype])
        self._launcher.launch(ks.WRITE_KV, targs, (min(tokens, _GRID_STRIDE_BLOCKS),), threads, args)

    def _attention_splits(self, base_blocks: int, max_ctx: int) -> tuple[int, int]:
        """(num_splits, split_len): split long contexts until the grid has many blocks per SM.

        Many small blocks rather than one wave of big ones: the last, partly filled wave costs less.
        """
        want = _cdiv(16 * self._launcher.sm_count, max(base_blocks, 1))
        splits = max(1, min(want, _cdiv(max_ctx, SPLIT_MIN), _MAX_SPLITS))
        split_len = _cdiv(max(max_ctx, 1), splits)
        return _cdiv(max(max_ctx, 1), split_len), split_len

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
        if softcap is not None:
            raise InternalError(
                "CudaOps was asked to cap attention scores, which ModelConfig.check_device refuses on CUDA"
            )
        op = "paged_attention_decode"
        checks.check_paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, sliding_window)
        self._on_device(op, "k_cache", k_cache)
        batch, hq, d = q.shape
        block_size, hk = k_cache.shape[1], k_cache.shape[2]
        out = torch.empty((batch, hq, d), dtype=q.dtype, device=q.device)
        if batch == 0 or d == 0:
            return out
        if block_tables.shape[1] == 0:
            checks.fail(op, "block_tables has no columns: every sequence needs the blocks of its context")
        ctype = ks.ELEMENT_TYPES[q.dtype]
        epl = 16 // q.element_size()
        if d > 32 * epl:
            epl *= 2  # fp32 heads above 128 elements: two 16-byte packs per lane
        group = _next_pow2(_cdiv(d, epl))
        qpk = hq // hk
        hp = min(max(ks.ATTENTION_HEADS_PER_PASS), _next_pow2(qpk))
        passes = _cdiv(qpk, hp)
        window = sliding_window or 0
        max_ctx = block_tables.shape[1] * block_size
        if window:
            max_ctx = min(max_ctx, window)
        num_splits, split_len = self._attention_splits(batch * hk * passes, max_ctx)
        part_acc = part_ml = None
        if num_splits > 1:
            part_acc = torch.empty((batch, hq, num_splits, d), dtype=torch.float32, device=q.device)
            part_ml = torch.empty((batch, hq, num_splits, 2), dtype=torch.float32, device=q.device)
        threads = ks.ATTENTION_THREADS
        smem = (threads // 32) * hp * (2 + group * epl) * 4
        args = (
            _ptr(out),
            _ptr(part_acc),
            _ptr(part_ml),
            _ptr(q),
            _i64(q.stride(0)),
            _ptr(k_cache),
            _ptr(v_cache),
            _ptr(block_tables),
            _i64(block_tables.stride(0)),
            _ptr(seq_lens),
            _i32(hq),
            _i32(hk),
            _i32(d),
            _i32(block_size.bit_length() - 1),
            _i32(group.bit_length() - 1),
            _i32(window),
            _i32(num_splits),
            _i32(split_len),
            np.float32(scale * _LOG2E),
        )
        grid = (hk * passes, batch, num_splits)
        targs = (ctype, hp, epl, ks.attention_tokens_per_lane(ctype, hp, epl))
        self._launcher.launch(ks.PAGED_ATTENTION_DECODE, targs, grid, threads, args, shared_mem=smem)
        if num_splits > 1:
            args = (
                _ptr(out),
                _ptr(part_acc),
                _ptr(part_ml),
                _ptr(seq_lens),
                _i32(hq),
                _i32(d),
                _i32(window),
                _i32(num_splits),
                _i32(split_len),
            )
            self._launcher.launch(
                ks.PAGED_ATTENTION_REDUCE, (ctype,), (hq, batch), threads, args, shared_mem=num_splits * 4
            )
        return out

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
        sizes: tuple[int, int] | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if softcap is not None:
            raise InternalError(
                "CudaOps was asked to cap attention scores, which ModelConfig.check_device refuses on CUDA"
            )
        checks.check_prefill_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, sliding_window)
        self._on_device("prefill_attention", "k_cache", k_cache)
        if sizes is None:
            # read back once per step, not at every layer: each read-back drains the GPU's queue of launches
            sizes = self._step_memo.get(
                "prefill_sizes", (query_start_loc, seq_lens), lambda: prefill_sizes(query_start_loc, seq_lens)
            )
        return sdpa_prefill_attention(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window, sizes
        )

    # ---- LoRA ----

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
        self._on_device("lora_decode_meta", "token_slots", token_slots)
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
        return not self._use_sgmv(meta, meta.extra["num_tiles"] * _cdiv(rows, ks.SGMV_SHRINK_ROWS))

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
        self._on_device(op, "x", x)
        self._on_device(op, "y", y)
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
        k_slice = _cdiv(_cdiv(k, cluster), vec) * vec
        packed = int(k % vec == 0 and a_stack.data_ptr() % 16 == 0)  # x is staged through shared memory
        packed |= 2 * int(rank % vec == 0 and b_stack.data_ptr() % 16 == 0)
        smem = (k_slice + 2 * rows) * 4
        args = (
            _ptr(y),
            _i64(y.stride(0)),
            _ptr(x),
            _i64(x.stride(0)),
            _ptr(a_stack),
            _ptr(b_stack),
            _ptr(meta.token_slots),
            _ptr(ranks),
            _ptr(self._device_offsets(offsets)),
            _i32(k),
            _i32(rows),
            _i32(rank),
            _i32(n_slices),
            _i32(out_total),
            _i32(k_slice),
            _i32(_cdiv(out_total, cluster)),
            _i32(packed),
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
        self._on_device(op, "meta.token_slots", meta.token_slots)
        ranks = meta.extra.get("slot_ranks")
        if ranks is None:
            return None, rows
        max_rank = meta.extra.get("max_rank")
        checks.check_slot_ranks(op, ranks, max_rank, meta.num_slots, rows)
        self._on_device(op, "meta.extra['slot_ranks']", ranks)
        return ranks, int(max_rank)

    def lora_shrink(self, x: torch.Tensor, a_stack: torch.Tensor, meta: LoraMeta) -> torch.Tensor:
        tokens = meta.token_slots.shape[0]
        checks.check_lora_shrink(x, a_stack, tokens, meta.num_slots)
        self._on_device("lora_shrink", "x", x)
        rows, k = a_stack.shape[1], x.shape[1]
        ranks, rank = self._lora_tables("lora_shrink", meta, rows)
        if tokens == 0 or rows == 0 or k == 0 or not meta.extra["any_adapter"]:
            return torch.zeros((tokens, rows), dtype=x.dtype, device=x.device)
        h = torch.empty((tokens, rows), dtype=x.dtype, device=x.device)
        tiles = meta.extra["num_tiles"]
        ctype = ks.ELEMENT_TYPES[x.dtype]
        if self._use_sgmv(meta, tiles * _cdiv(rows, ks.SGMV_SHRINK_ROWS)):
            targs, grid = (ctype, ks.SGMV_TILE, ks.SGMV_SHRINK_ROWS), (tiles, _cdiv(rows, ks.SGMV_SHRINK_ROWS))
            tile_starts = meta.extra["tile_starts"]
        else:
            targs, grid = (ctype, 1, ks.BGMV_SHRINK_ROWS), (tokens, _cdiv(rows, ks.BGMV_SHRINK_ROWS))
            tile_starts = None
        args = (
            _ptr(h),
            _ptr(x),
            _i64(x.stride(0)),
            _ptr(a_stack),
            _ptr(meta.token_slots),
            _ptr(tile_starts),
            _ptr(ranks),
            _i32(tokens),
            _i32(k),
            _i32(rows),
            _i32(rank),
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
        self._on_device("lora_expand", "y", y)
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
        col_blocks = _cdiv(widest, ks.LORA_EXPAND_THREADS)
        if self._use_sgmv(meta, tiles * col_blocks * n_slices):
            toks, grid, tile_starts = ks.SGMV_TILE, (tiles, col_blocks, n_slices), meta.extra["tile_starts"]
        else:
            toks, grid, tile_starts = 1, (tokens, col_blocks, n_slices), None
        args = (
            _ptr(y),
            _i64(y.stride(0)),
            _ptr(h),
            _ptr(b_stack),
            _ptr(meta.token_slots),
            _ptr(tile_starts),
            _ptr(ranks),
            _ptr(self._device_offsets(offsets)),
            _i32(tokens),
            _i32(n_slices),
            _i32(rank),
            _i32(offsets[-1]),
        )
        targs = (ks.ELEMENT_TYPES[y.dtype], toks)
        self._launcher.launch(ks.LORA_EXPAND, targs, grid, ks.LORA_EXPAND_THREADS, args, shared_mem=toks * rank * 4)
