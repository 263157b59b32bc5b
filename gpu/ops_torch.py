"""TorchOps: the device ops in plain torch; the CPU path and the oracle the CUDA kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraledger.gpu import activation_cpu_kernel, attention_cpu_kernel, rms_norm_cpu_kernel, rotary_cpu_kernel
from loraledger.gpu.ops import Ops, StepMemo
from loraledger.gpu.ops_torch_lora import TorchLoraOps

# A prefill step whose longest context is at most this many tokens runs its attention through the CPU decode
# kernel, one query row at a time over its causal prefix: no padding, mask, gather or fp32 copies. Its cost
# grows with the square of the context, SDPA's blocked products' more slowly; bf16, GQA 8/2 x 64, 2 threads on
# an AVX512-BF16 EPYC: 24 prompts of 16 / 48 / 64 tokens 0.43 / 2.3 / 3.8 ms a layer against SDPA's 0.74 / 2.8 /
# 4.4, behind it at 8 prompts of 128 (`python -m bench.run --only cpu-attention`; bench/RESULTS.md, "CPU: the
# decode attention kernel, and short prefills through it").
KERNEL_PREFILL_MAX_CONTEXT = 80


class TorchOps(TorchLoraOps, Ops):
    name = "torch"

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
        fused = rms_norm_cpu_kernel.rms_norm(x, weight, eps, residual)  # on the CPU, one C pass per row
        if fused is not None:
            return fused
        return self.plain_rms_norm(x, weight, eps, residual)

    def plain_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rms_norm in torch ops (other devices and dtypes, and the CPU kernel's twin in the tests)."""
        r = x if residual is None else x + residual
        rf = r.float()
        out = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)
        return (out * weight.float()).to(x.dtype), r

    def rotary_embedding(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> None:
        for x in _heads_to_rotate(q, k):
            if not rotary_cpu_kernel.rotate(x, positions, cos_sin_cache):  # on the CPU, one C pass in place
                self._plain_rotate(positions, x, cos_sin_cache)

    def plain_rotary_embedding(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> None:
        """rotary_embedding in torch ops (other devices and dtypes, and the CPU kernel's twin in the tests)."""
        for x in _heads_to_rotate(q, k):
            self._plain_rotate(positions, x, cos_sin_cache)

    def _plain_rotate(self, positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
        half = cos_sin_cache.shape[-1] // 2

        def gather():
            cs = cos_sin_cache.index_select(0, positions)
            return cs[:, None, :half], cs[:, None, half:]

        cos, sin = self._per_step("rotary", (positions, cos_sin_cache), gather)
        x1 = x[..., :half].float()
        x2 = x[..., half:].float()
        # both halves are computed before either is written: x1/x2 may alias x
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        x[..., :half].copy_(o1)
        x[..., half:].copy_(o2)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        out = activation_cpu_kernel.silu_and_mul(x)  # on the CPU, one C pass
        return self.plain_silu_and_mul(x) if out is None else out

    def plain_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu_and_mul in torch ops (other devices and dtypes, and the CPU kernel's twin in the tests)."""
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
        # on the CPU, the C kernel reads the paged cache in place (gpu/attention_cpu_kernel.py); None: it does not apply
        out = attention_cpu_kernel.decode(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap)
        if out is not None:
            return out
        return self.gathered_attention_decode(
            q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap
        )

    def gathered_attention_decode(
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
        """paged_attention_decode in torch: the sequences' blocks gathered, masked and handed to SDPA (the path on
        other devices, where the CPU kernel does not apply, and its twin in the tests)."""
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
        # bf16 on the CPU: SDPA's kernel takes the bf16 K and V as gathered (see _sdpa's native_bf16)
        out = _sdpa(q_grouped, keys, values, allowed, scale, softcap, native_bf16=True)
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
        if q.device.type == "cpu" and 0 < q.shape[0]:
            limit = KERNEL_PREFILL_MAX_CONTEXT
            rows = self._per_step(
                "prefill_rows", (query_start_loc, seq_lens, block_tables, limit), lambda: _prefill_rows(
                    query_start_loc, seq_lens, block_tables, q.shape[0], limit)
            )  # fmt: skip
            if rows is not None:
                out = attention_cpu_kernel.decode(q, k_cache, v_cache, *rows, scale, sliding_window, softcap)
                if out is not None:
                    return out
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


def _prefill_rows(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, total: int, limit: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each query row of a prefill step as a decode row of the CPU attention kernel: its sequence's block table
    and, as its length, its own position + 1 (causal attention over the cache, where its chunk's keys already are).
    [total, width] int32 tables and [total] int32 lengths; None where the step is not the kernel's: a context
    longer than `limit`, or int64 block tables (the kernel reads int32 ids: a narrowed int64 one could wrap)."""
    if block_tables.dtype != torch.int32 or int(seq_lens.max()) > limit:
        return None
    starts = query_start_loc.to(torch.int64)
    q_lens = starts[1:] - starts[:-1]
    row_of, offset = _query_rows(starts, q_lens, total)
    positions = (seq_lens.to(torch.int64) - q_lens)[row_of] + offset  # a chunk's first query row: seq_len - q_len
    return block_tables.index_select(0, row_of), (positions + 1).to(torch.int32)


def _query_rows(starts: torch.Tensor, q_lens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of a step's `total` query rows (chunks from `starts`, q_lens rows each): its chunk, and its offset
    in that chunk."""
    row_of = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=starts.device), q_lens, output_size=total)
    return row_of, torch.arange(total, device=starts.device) - starts[:-1][row_of]


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
        row_of, offset = _query_rows(starts, q_lens, total)
        padded_at = row_of * max_q + offset
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


def _heads_to_rotate(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q and k as one view where k's heads follow q's in memory (one pass rotates both), else each apart."""
    qk = _adjacent_heads(q, k)
    return (q, k) if qk is None else (qk,)


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


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    native_bf16: bool = False,
) -> torch.Tensor:
    """q [B, Hq, Q, D], k/v [B, Hk, L, D], mask [B, 1, Q, L] bool (True = attend); softmax in fp32.

    With softcap c the scores are capped as c * tanh(s / c), which SDPA cannot do: computed in full then.
    native_bf16 (decode only): bf16 on the CPU goes to SDPA without the fp32 copies of q, K and V, which cost a
    decode step more than the attention itself; SDPA's CPU kernel still accumulates the scores and the softmax
    in fp32 (only the probabilities are rounded to bf16 before the product with V). Prefill keeps the copies:
    without them a bf16 model's greedy ids drift further from transformers' (tests/gpu/test_cpu_bf16.py).
    """
    native = native_bf16 and q.dtype == torch.bfloat16 and q.device.type == "cpu" and softcap is None
    if q.dtype != torch.float32 and not native:
        q, k, v = q.float(), k.float(), v.float()
    if softcap is not None:
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * (scale / softcap)) * softcap
        return torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
