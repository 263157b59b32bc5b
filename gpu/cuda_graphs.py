"""DecodeGraphs: CUDA graphs of the decode-only forward pass, one per padded batch size, with and without LoRA.

A decode step launches about twenty kernels per layer. Launched one by one from Python (torch ops
and CuPy RawKernels), each costs tens of microseconds of host time, more than the GPU work of a
decode step of a small model at serving batch sizes. A captured graph replays every launch at once.

Each graph reads its inputs from static device buffers that a step copies into (one host-to-device
copy per buffer, from pinned memory) and writes its logits into a static output. What the kernels
fix at capture time is held at its maximum: the block-table width covers max_model_len, and the
LoRA kernels run for every row (rows without an adapter, slot -1, exit at once), so one graph
serves every later mix of adapters. Rows past the step's sequences are padding: slot -1, KV slot -1
(never written), context length 1 over block 0.

Graphs are captured lazily, the first time a (size, LoRA or not) step comes; a capture costs a few
forward passes, and one that fails (out of memory, say) is logged and leaves those steps eager.
Each graph keeps its own fp32 logits output ([size, vocab]): with a 128k vocabulary and every size
up to 256 captured, with and without LoRA, that is about 1.6 GB. Only steps whose every sequence
brings one token and wants only its sampled token's logits take this path; prefill and
prompt-logprob steps run eagerly.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch

from loraledger.errors import KernelInputError
from loraledger.gpu.forward_batch import ForwardBatch, check_block_tables, fill_block_tables
from loraledger.gpu.kv_cache import KVCache
from loraledger.logging import get_logger
from loraledger.lora.device_slots import LoraSlots
from loraledger.scheduling.step_plan import SeqWork

log = get_logger("cuda_graphs")

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def capture_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes graphs are captured for: CAPTURE_SIZES up to max_batch, and max_batch itself."""
    sizes = [s for s in CAPTURE_SIZES if s < max_batch]
    return [*sizes, max_batch]


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_cache: KVCache,
        lora_slots: LoraSlots | None,
        *,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.lora_slots = lora_slots
        self.block_size = block_size
        self.device = device
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_len = max_model_len  # the longest context a graph serves (vLLM's max_seq_len_to_capture)
        self.width = -(-max_model_len // block_size)
        m = self.max_batch
        # int64: input ids, positions, KV slots; int32: context lengths, adapter slots, block tables
        self._host64 = torch.zeros(3 * m, dtype=torch.int64, pin_memory=True)
        self._host32 = torch.zeros(2 * m + m * self.width, dtype=torch.int32, pin_memory=True)
        self._dev64 = torch.zeros(3 * m, dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(2 * m + m * self.width, dtype=torch.int32, device=device)
        self._rows = torch.arange(m, dtype=torch.int64, device=device)
        h64, h32 = self._host64.numpy(), self._host32.numpy()
        self._ids, self._pos, self._kv_slots = h64[:m], h64[m : 2 * m], h64[2 * m :]
        self._lens, self._slots = h32[:m], h32[m : 2 * m]
        self._tables = h32[2 * m :].reshape(m, self.width)
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._failed: set[tuple[int, bool]] = set()  # captures that raised: those steps run eagerly
        self._uploaded: torch.cuda.Event | None = None  # recorded after the last upload from the pinned buffers
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def captured(self) -> list[tuple[int, bool]]:
        return sorted(self._graphs)

    def graph(self, size: int, with_lora: bool) -> torch.cuda.CUDAGraph:
        """The captured graph of a (padded size, LoRA or not) step, for timing its replay alone (bench.gpu_step)."""
        return self._graphs[(size, with_lora)][0]

    def accepts(self, seqs: Sequence[SeqWork]) -> bool:
        """Whether a step of these (ordered) sequences can replay a graph: all one-token, sampling, no prompt logprobs,
        each context at most max_len tokens (a longer one runs eagerly, as vLLM does past max_seq_len_to_capture)."""
        return 0 < len(seqs) <= self.max_batch and all(
            len(s.token_ids) == 1
            and s.sample
            and not s.prompt_logprobs
            and s.start_pos < self.max_len
            and len(s.block_table) <= self.width
            for s in seqs
        )

    def run(
        self, seqs: Sequence[SeqWork], pending: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor | None:
        """Logits [len(seqs), V] (fp32) of one decode step, a view of the graph's output valid until the
        next run; None when this step's graph could not be captured (the caller runs the step eagerly).

        pending: (rows, token ids), both int64 on the device: the input ids of those rows, sampled by
        the previous step and still on the device (their host value is PENDING_TOKEN)."""
        n = len(seqs)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        with_lora = self.lora_slots is not None and any(s.lora_slot >= 0 for s in seqs)
        key = (size, with_lora)
        if key in self._failed:
            return None
        # the graph's capture stream and the kernels' current stream belong to the current device
        with torch.cuda.device(self.device):
            entry = self._graphs.get(key)
            if entry is None:
                try:
                    entry = self._capture(size, with_lora)
                except (RuntimeError, KernelInputError) as exc:  # out of memory, a launch refused in capture
                    self._failed.add(key)
                    log.warning(
                        "CUDA graph capture failed; these steps run eagerly", size=size, lora=with_lora, error=repr(exc)
                    )
                    return None
            self._fill(seqs, size)
            if pending is not None:
                self._dev64.index_copy_(0, pending[0], pending[1])  # rows < size: the input ids' part
            graph, logits = entry
            graph.replay()
        return logits[:n]

    # ---- inputs ----

    def _pad(self, start: int, stop: int) -> None:
        """Rows [start, stop) padding: no adapter, nothing written to the KV cache, one position of context in block 0."""
        self._ids[start:stop] = 0
        self._pos[start:stop] = 0
        self._kv_slots[start:stop] = -1
        self._lens[start:stop] = 1
        self._slots[start:stop] = -1
        self._tables[start:stop, 0] = 0  # a row's table is read only as far as its context: one block here

    def _upload(self, size: int) -> None:
        """Copy what a graph of `size` rows reads: all of the int64 buffer, the int32 one up to row `size` of the tables.

        The copies are queued behind whatever runs on the stream (an overlapped step's previous step);
        _writable() makes the next writer of the pinned buffers wait until they have been read.
        """
        self._dev64.copy_(self._host64, non_blocking=True)
        used = 2 * self.max_batch + size * self.width
        self._dev32[:used].copy_(self._host32[:used], non_blocking=True)
        self._uploaded = torch.cuda.Event()
        self._uploaded.record(torch.cuda.current_stream(self.device))

    def _writable(self) -> None:
        """Wait until the last upload has read the pinned buffers (not for the kernels queued after it)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
            self._uploaded = None

    def _fill(self, seqs: Sequence[SeqWork], size: int) -> None:
        n, bs = len(seqs), self.block_size
        self._writable()
        self._pad(n, size)
        pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)
        self._ids[:n] = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64, count=n)
        self._pos[:n] = pos
        self._lens[:n] = pos + 1
        self._slots[:n] = np.fromiter((s.lora_slot for s in seqs), dtype=np.int32, count=n)
        bt_lens = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=n)
        check_block_tables(seqs, bt_lens, pos + 1, bs)  # build_forward_batch's guard: it is not called here
        # columns past a row's own blocks keep stale values: the kernels read only as far as seq_lens
        fill_block_tables(self._tables, seqs, bt_lens)
        self._kv_slots[:n] = self._tables[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        self._upload(size)

    # ---- capture ----

    def _static_batch(self, size: int, with_lora: bool) -> ForwardBatch:
        m = self.max_batch
        lora, groups = None, frozenset()
        if with_lora:
            token_slots = self._dev32[m : m + size]
            lora = self.model.ops.lora_decode_meta(token_slots, self.lora_slots.max_loras)
            lora.extra.update(self.lora_slots.rank_table())  # read at replay: slot loads update it in place
            groups = frozenset(self.lora_slots.stacks)
        return ForwardBatch(
            input_ids=self._dev64[:size],
            positions=self._dev64[m : m + size],
            slot_mapping=self._dev64[2 * m : 2 * m + size],
            num_decode=size,
            decode_block_tables=self._dev32[2 * m :].view(m, self.width)[:size],
            decode_seq_lens=self._dev32[:size],
            prefill_query_start_loc=None,
            prefill_seq_lens=None,
            prefill_block_tables=None,
            logits_indices=self._rows[:size],
            lora=lora,
            lora_groups=groups,
        )

    def _capture(self, size: int, with_lora: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        batch = self._static_batch(size, with_lora)
        self._writable()
        self._pad(0, size)
        self._upload(size)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles the kernels and fills the ops' caches outside the capture
                self.model.forward(batch, self.kv_cache)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self.model.forward(batch, self.kv_cache)
        current.synchronize()  # the padding upload has been read before _fill rewrites the pinned buffers
        entry = (graph, logits)
        self._graphs[(size, with_lora)] = entry
        return entry

    def close(self) -> None:
        self._graphs.clear()
        self.model = self.kv_cache = self.lora_slots = None
