"""ForwardBatch: one step's flat input tensors, built with vectorised numpy from the scheduled sequences."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loraledger.errors import InternalError
from loraledger.gpu.ops import LoraMeta, Ops
from loraledger.gpu.transfer import to_device
from loraledger.lora.device_slots import LoraSlots
from loraledger.scheduling.step_plan import SeqWork


@dataclass
class ForwardBatch:
    """Tokens of B sequences laid end to end: the D single-token (decode) sequences first, then P chunks."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: KV cache slot of each token
    num_decode: int  # D: tokens [0, D) are one per decode sequence
    decode_block_tables: torch.Tensor | None  # [D, blocks] int32
    decode_seq_lens: torch.Tensor | None  # [D] int32
    prefill_query_start_loc: torch.Tensor | None  # [P + 1] int32, relative to token D
    prefill_seq_lens: torch.Tensor | None  # [P] int32
    prefill_block_tables: torch.Tensor | None  # [P, blocks] int32
    logits_indices: torch.Tensor  # [N] int64: the token rows whose logits are computed
    lora: LoraMeta | None  # None: no adapter token in the step
    lora_groups: frozenset[str]  # fused modules targeted by some active slot; the rest skip LoRA
    prefill_sizes: tuple[int, int] | None = (
        None  # (longest query chunk, longest context) of the P chunks, known on the host
    )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class BatchLayout:
    """Host-side bookkeeping of where each sequence's tokens and logits rows are (numpy, [B] each)."""

    q_lens: np.ndarray
    token_start: np.ndarray
    start_pos: np.ndarray
    logits_start: np.ndarray  # first logits row of the sequence
    logits_count: np.ndarray  # its number of logits rows (0, 1, or q_len for prompt logprobs)
    sample_row: np.ndarray  # logits row to sample from, -1 when the sequence samples nothing


def order_for_batch(seqs: Sequence[SeqWork]) -> tuple[list[SeqWork], int]:
    """Single-token (decode-like) sequences first, then the multi-token chunks; each part sorted by adapter slot.

    Sorting by slot (stable) makes each adapter's tokens one contiguous run per part, which the LoRA
    ops turn into plain GEMMs on views once a run is long enough.
    """
    decode = sorted((s for s in seqs if len(s.token_ids) == 1), key=lambda s: s.lora_slot)
    prefill = sorted((s for s in seqs if len(s.token_ids) != 1), key=lambda s: s.lora_slot)
    return decode + prefill, len(decode)


def check_block_tables(
    seqs: Sequence[SeqWork], bt_lens: np.ndarray, seq_lens: np.ndarray, block_size: int
) -> np.ndarray:
    """Blocks each sequence needs for its context; InternalError naming the first whose table is shorter."""
    blocks_needed = -(-seq_lens // block_size)
    short = np.nonzero(bt_lens < blocks_needed)[0]
    if short.size:
        s = seqs[int(short[0])]
        raise InternalError(
            f"sequence {s.seq_id}: block table has {len(s.block_table)} blocks, "
            f"{int(blocks_needed[short[0]])} are needed for {int(seq_lens[short[0]])} tokens "
            f"of block_size {block_size}"
        )
    return blocks_needed


def fill_block_tables(out: np.ndarray, seqs: Sequence[SeqWork], bt_lens: np.ndarray) -> None:
    """Row i of `out` [>= B, width] gets sequence i's block table; the columns past it are left as they are."""
    rows = np.repeat(np.arange(len(seqs)), bt_lens)
    cols = np.arange(int(bt_lens.sum())) - np.repeat(np.cumsum(bt_lens) - bt_lens, bt_lens)
    out[rows, cols] = np.fromiter(
        itertools.chain.from_iterable(s.block_table for s in seqs), dtype=out.dtype, count=int(bt_lens.sum())
    )


def build_forward_batch(
    seqs: Sequence[SeqWork],
    num_decode: int,
    *,
    block_size: int,
    device: torch.device,
    ops: Ops,
    lora_slots: LoraSlots | None,
) -> tuple[ForwardBatch, BatchLayout]:
    """Flatten already-ordered sequences (see order_for_batch) into the step's input tensors."""
    num_seqs = len(seqs)
    q_lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=num_seqs)
    total = int(q_lens.sum())
    token_start = np.cumsum(q_lens) - q_lens
    start_pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=num_seqs)
    token_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs), dtype=np.int64, count=total)
    seq_of = np.repeat(np.arange(num_seqs), q_lens)
    positions = start_pos[seq_of] + (np.arange(total) - token_start[seq_of])
    seq_lens = start_pos + q_lens

    bt_lens = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=num_seqs)
    blocks_needed = check_block_tables(seqs, bt_lens, seq_lens, block_size)
    tables = np.zeros((num_seqs, max(int(bt_lens.max()), 1)), dtype=np.int64)
    fill_block_tables(tables, seqs, bt_lens)
    slot_mapping = tables[seq_of, positions // block_size] * block_size + positions % block_size

    sample = np.fromiter((s.sample for s in seqs), dtype=bool, count=num_seqs)
    wants_prompt = np.fromiter((s.prompt_logprobs for s in seqs), dtype=bool, count=num_seqs)
    logits_count = np.where(wants_prompt, q_lens, sample.astype(np.int64))
    logits_start = np.cumsum(logits_count) - logits_count
    n_rows = int(logits_count.sum())
    row_seq = np.repeat(np.arange(num_seqs), logits_count)
    row_in_seq = np.arange(n_rows) - logits_start[row_seq]
    logits_indices = (token_start + q_lens - logits_count)[row_seq] + row_in_seq
    sample_row = np.where(sample, logits_start + logits_count - 1, -1)

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return to_device(a, dtype, device)

    dec_bt = dec_lens = pf_loc = pf_lens = pf_bt = pf_sizes = None
    if num_decode:
        dec_bt = dev(tables[:num_decode, : int(blocks_needed[:num_decode].max())], torch.int32)
        dec_lens = dev(seq_lens[:num_decode], torch.int32)
    if num_decode < num_seqs:
        pf_q = q_lens[num_decode:]
        pf_loc = dev(np.concatenate(([0], np.cumsum(pf_q))), torch.int32)
        pf_lens = dev(seq_lens[num_decode:], torch.int32)
        pf_bt = dev(tables[num_decode:, : int(blocks_needed[num_decode:].max())], torch.int32)
        pf_sizes = (int(pf_q.max()), int(seq_lens[num_decode:].max()))

    lora_meta, groups = None, frozenset()
    if lora_slots is not None:
        slots = np.fromiter((s.lora_slot for s in seqs), dtype=np.int64, count=num_seqs)
        active = np.unique(slots[slots >= 0])
        if active.size:
            groups = lora_slots.groups_for(active.tolist())
        if groups:
            # host slots: the backend uploads what it needs (no read-back of a device copy)
            token_slots = torch.from_numpy(np.repeat(slots, q_lens).astype(np.int32))
            lora_meta = ops.lora_prepare(token_slots, lora_slots.max_loras)
            lora_meta.extra.update(lora_slots.rank_table())

    batch = ForwardBatch(
        input_ids=dev(token_ids, torch.int64),
        positions=dev(positions, torch.int64),
        slot_mapping=dev(slot_mapping, torch.int64),
        num_decode=num_decode,
        decode_block_tables=dec_bt,
        decode_seq_lens=dec_lens,
        prefill_query_start_loc=pf_loc,
        prefill_seq_lens=pf_lens,
        prefill_block_tables=pf_bt,
        logits_indices=dev(logits_indices, torch.int64),
        lora=lora_meta,
        lora_groups=groups,
        prefill_sizes=pf_sizes,
    )
    layout = BatchLayout(
        q_lens=q_lens,
        token_start=token_start,
        start_pos=start_pos,
        logits_start=logits_start,
        logits_count=logits_count,
        sample_row=sample_row,
    )
    return batch, layout


def decode_layout(seqs: Sequence[SeqWork]) -> BatchLayout:
    """The layout of a step of one-token sequences that each sample: token, logits row and sample row i for sequence i."""
    n = len(seqs)
    rows = np.arange(n, dtype=np.int64)
    ones = np.ones(n, dtype=np.int64)
    start_pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)
    return BatchLayout(
        q_lens=ones, token_start=rows, start_pos=start_pos, logits_start=rows, logits_count=ones, sample_row=rows
    )
