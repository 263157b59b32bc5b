"""CudaOps' KV-cache and attention ops: the KV write and paged decode attention kernels, and prefill by torch SDPA.

Prefill attention is the one op without a kernel of its own: it gathers each sequence's cached
context and calls torch's scaled_dot_product_attention, whose fused CUDA kernels already run
causal attention near peak; what needed custom kernels is the decode path, where the context is
paged and each sequence brings one query.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from loraledger.errors import InternalError
from loraledger.gpu import kernel_checks as checks
from loraledger.gpu import kernel_sources as ks
from loraledger.gpu.kernel_args import GRID_STRIDE_BLOCKS, cdiv, i32, i64, next_pow2, ptr
from loraledger.gpu.kernel_launcher import KernelLauncher
from loraledger.gpu.ops import Ops, StepMemo

_LOG2E = 1.4426950408889634
SPLIT_MIN = 1024  # the shortest context span worth its own paged-attention block (H100 sweep: 256 -> 1024 took U = 2 from 51 % to 55 % of copy bandwidth)
_MAX_SPLITS = 1024  # the reduce kernel keeps one fp32 weight per split in shared memory


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
    used = cdiv(max(max_len, 1), block_size)
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


class CudaAttentionOps(Ops):
    """The KV-cache and attention ops of CudaOps (a base class of it: it launches through CudaOps' launcher)."""

    device: torch.device
    _launcher: KernelLauncher
    _step_memo: StepMemo

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        checks.check_write_kv(key, value, k_cache, v_cache, slot_mapping)
        checks.require_device("write_kv", "k_cache", k_cache, self.device)
        tokens = key.shape[0]
        row = k_cache.shape[2] * k_cache.shape[3]
        if tokens == 0 or row == 0:
            return
        vec = 16 // key.element_size()
        threads = min(256, max(32, cdiv(cdiv(row, vec), 32) * 32))
        args = (
            ptr(k_cache),
            ptr(v_cache),
            ptr(key),
            i64(key.stride(0)),
            ptr(value),
            i64(value.stride(0)),
            ptr(slot_mapping),
            i32(tokens),
            i32(row),
        )
        targs = (ks.ELEMENT_TYPES[key.dtype], ks.INDEX_TYPES[slot_mapping.dtype])
        self._launcher.launch(ks.WRITE_KV, targs, (min(tokens, GRID_STRIDE_BLOCKS),), threads, args)

    def _attention_splits(self, base_blocks: int, max_ctx: int) -> tuple[int, int]:
        """(num_splits, split_len): split long contexts until the grid has many blocks per SM.

        Many small blocks rather than one wave of big ones: the last, partly filled wave costs less.
        """
        want = cdiv(16 * self._launcher.sm_count, max(base_blocks, 1))
        splits = max(1, min(want, cdiv(max_ctx, SPLIT_MIN), _MAX_SPLITS))
        split_len = cdiv(max(max_ctx, 1), splits)
        return cdiv(max(max_ctx, 1), split_len), split_len

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
        checks.require_device(op, "k_cache", k_cache, self.device)
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
        group = next_pow2(cdiv(d, epl))
        qpk = hq // hk
        hp = min(max(ks.ATTENTION_HEADS_PER_PASS), next_pow2(qpk))
        passes = cdiv(qpk, hp)
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
            ptr(out),
            ptr(part_acc),
            ptr(part_ml),
            ptr(q),
            i64(q.stride(0)),
            ptr(k_cache),
            ptr(v_cache),
            ptr(block_tables),
            i64(block_tables.stride(0)),
            ptr(seq_lens),
            i32(hq),
            i32(hk),
            i32(d),
            i32(block_size.bit_length() - 1),
            i32(group.bit_length() - 1),
            i32(window),
            i32(num_splits),
            i32(split_len),
            np.float32(scale * _LOG2E),
        )
        grid = (hk * passes, batch, num_splits)
        targs = (ctype, hp, epl, ks.attention_tokens_per_lane(ctype, hp, epl))
        self._launcher.launch(ks.PAGED_ATTENTION_DECODE, targs, grid, threads, args, shared_mem=smem)
        if num_splits > 1:
            args = (
                ptr(out),
                ptr(part_acc),
                ptr(part_ml),
                ptr(seq_lens),
                i32(hq),
                i32(d),
                i32(window),
                i32(num_splits),
                i32(split_len),
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
        checks.require_device("prefill_attention", "k_cache", k_cache, self.device)
        if sizes is None:
            # read back once per step, not at every layer: each read-back drains the GPU's queue of launches
            sizes = self._step_memo.get(
                "prefill_sizes", (query_start_loc, seq_lens), lambda: prefill_sizes(query_start_loc, seq_lens)
            )
        return sdpa_prefill_attention(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window, sizes
        )
