"""ModelRunner: owns weights, KV cache, adapter slots and sampling state; executes one StepPlan at a time."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from loraledger.errors import ConfigError, EngineDeadError, LoRADisabledError
from loraledger.gpu.config import ModelConfig
from loraledger.gpu.cuda_graphs import DecodeGraphs
from loraledger.gpu.forward_batch import BatchLayout, build_forward_batch, decode_layout, order_for_batch
from loraledger.gpu.kv_cache import KVCache
from loraledger.gpu.lora_slots import LoraSlots
from loraledger.gpu.model import Model
from loraledger.gpu.ops import Ops
from loraledger.gpu.sampler import Sampler, SampleRow
from loraledger.gpu.step import PromptLogprobs, SampledToken, SamplingSpec, SeqWork, StepOutput, StepPlan
from loraledger.gpu.weights import load_weights


@dataclass
class SeqState:
    """A sequence's sampling settings and token history, kept from its NewSeq until it is freed."""

    spec: SamplingSpec
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: torch.dtype,
        device: torch.device,
        ops: Ops,
        num_kv_blocks: int,
        block_size: int,
        max_loras: int,
        max_lora_rank: int,
        enable_lora: bool,
        max_num_batched_tokens: int,
        max_model_len: int | None = None,
        cuda_graph_max_batch: int = 0,
    ) -> None:
        """cuda_graph_max_batch > 0 (CUDA only): decode steps of up to that many sequences replay
        CUDA graphs (gpu/cuda_graphs.py) instead of launching each kernel from Python."""
        self.config = ModelConfig.from_pretrained(model_dir)
        self.device = torch.device(device)
        if self.device.type == "cpu":
            _keep_freed_memory()
        self.dtype = dtype
        self.ops = ops
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        weights = load_weights(model_dir, self.config, dtype=dtype, device=self.device)
        self.kv_cache = KVCache(self.config, num_kv_blocks, block_size, dtype, self.device)
        self.lora_slots = LoraSlots(self.config, max_loras, max_lora_rank, dtype, self.device) if enable_lora else None
        self.model = Model(self.config, weights, ops, lora_slots=self.lora_slots)
        self.sampler = Sampler(self.config.vocab_size, self.device)
        self.graphs: DecodeGraphs | None = None
        if cuda_graph_max_batch > 0:
            if self.device.type != "cuda" or ops.name != "cuda":
                raise ConfigError(
                    f"CUDA graphs need a CUDA device and CudaOps, not {self.device} with {ops.name} ops; "
                    "use cuda_graph_max_batch=0"
                )
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_cache,
                self.lora_slots,
                max_batch=cuda_graph_max_batch,
                max_model_len=max_model_len or self.config.max_position_embeddings,
                block_size=block_size,
                device=self.device,
            )
        self._seqs: dict[int, SeqState] = {}
        self._closed = False

    @property
    def num_live_seqs(self) -> int:
        return len(self._seqs)

    def close(self) -> None:
        """Drop every tensor (weights, KV cache, adapter slots, sampler state); execute() fails afterwards.

        The Executor calls this on the event loop when it stops. Otherwise the last reference to the
        runner can be the bound `execute` an anyio worker thread (a daemon) still holds after its last
        step; if that thread lets go while the interpreter is finalizing, torch's tensor deallocation
        releases and retakes the GIL, Python ends the thread with a forced unwind through C++ frames,
        and the process aborts ("terminate called without an active exception", exit code 134) after
        all its work is done. Closing here leaves such a reference holding an empty object.
        """
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self.model = None
        self.ops = None  # TorchOps keeps a KV workspace tensor between steps
        self.kv_cache = None
        self.lora_slots = None
        self.sampler = None
        self._seqs.clear()
        self._closed = True

    def execute(self, plan: StepPlan) -> StepOutput:
        """Apply the plan's slot and sequence changes, run one forward over its sequences, sample."""
        if self._closed:
            raise EngineDeadError("the model runner was closed (the engine shut down); start a new engine")
        with torch.inference_mode():
            t0 = time.perf_counter()
            self._apply_slot_changes(plan)
            for seq_id in plan.freed_seq_ids:
                self._seqs.pop(seq_id, None)
            for new in plan.new_seqs:
                self._seqs[new.seq_id] = SeqState(new.sampling, list(new.prompt_token_ids), list(new.output_token_ids))
            if not plan.seqs:
                return StepOutput(step_id=plan.step_id, sampled=[], prepare_seconds=time.perf_counter() - t0)
            seqs, num_decode = order_for_batch(plan.seqs)
            states = self._check(seqs)
            logits = None
            if self.graphs is not None and num_decode == len(seqs) and self.graphs.accepts(seqs):
                layout = decode_layout(seqs)
                t1 = time.perf_counter()
                logits = self.graphs.run(seqs)
            if logits is None:
                batch, layout = build_forward_batch(
                    seqs,
                    num_decode,
                    block_size=self.block_size,
                    device=self.device,
                    ops=self.ops,
                    lora_slots=self.lora_slots,
                )
                t1 = time.perf_counter()
                logits = self.model.forward(batch, self.kv_cache)
            sampled = self._sample(seqs, states, layout, logits)
            prompt_lps = self._prompt_logprobs(seqs, states, layout, logits)
            t2 = time.perf_counter()
        return StepOutput(
            step_id=plan.step_id,
            sampled=sampled,
            prompt_logprobs=prompt_lps,
            forward_seconds=t2 - t1,
            prepare_seconds=t1 - t0,
        )

    def _apply_slot_changes(self, plan: StepPlan) -> None:
        if (plan.slot_clears or plan.slot_loads) and self.lora_slots is None:
            raise LoRADisabledError("the step loads adapters, but the engine was built with enable_lora=False")
        for slot in plan.slot_clears:
            self.lora_slots.clear(slot)
        for load in plan.slot_loads:
            self.lora_slots.load(load.slot, load.checkpoint, load.fingerprint)

    def _check(self, seqs: list[SeqWork]) -> list[SeqState]:
        total = sum(len(s.token_ids) for s in seqs)
        if total > self.max_num_batched_tokens:
            raise ConfigError(
                f"the step has {total} tokens, above max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        states = []
        for s in seqs:
            state = self._seqs.get(s.seq_id)
            if state is None:
                raise ConfigError(
                    f"sequence {s.seq_id} is scheduled but was never announced in a NewSeq (or was freed)"
                )
            if s.lora_slot >= 0:
                if self.lora_slots is None:
                    raise LoRADisabledError(
                        f"sequence {s.seq_id} uses adapter slot {s.lora_slot}, but LoRA is disabled"
                    )
                if self.lora_slots.fingerprints[s.lora_slot] is None:
                    raise ConfigError(f"sequence {s.seq_id} uses adapter slot {s.lora_slot}, which holds no adapter")
            states.append(state)
        return states

    def _sample(
        self, seqs: list[SeqWork], states: list[SeqState], layout: BatchLayout, logits: torch.Tensor
    ) -> list[SampledToken]:
        which = np.nonzero(layout.sample_row >= 0)[0].tolist()
        if not which:
            return []
        rows = [SampleRow(states[i].spec, states[i].prompt_token_ids, states[i].output_token_ids) for i in which]
        row_idx = torch.from_numpy(layout.sample_row[which]).to(logits.device)
        out = self.sampler.sample(logits.index_select(0, row_idx), rows)
        sampled = []
        for j, i in enumerate(which):
            token = out.token_ids[j]
            states[i].output_token_ids.append(token)
            sampled.append(SampledToken(seqs[i].seq_id, token, out.logprobs[j], out.top_logprobs[j]))
        return sampled

    def _prompt_logprobs(
        self, seqs: list[SeqWork], states: list[SeqState], layout: BatchLayout, logits: torch.Tensor
    ) -> list[PromptLogprobs]:
        which = [i for i, s in enumerate(seqs) if s.prompt_logprobs]
        if not which:
            return []
        # logits row j of a chunk scores the prompt token at position start_pos + j + 1
        row_ids, targets, spans = [], [], []
        for i in which:
            prompt = states[i].prompt_token_ids
            start = int(layout.start_pos[i])
            count = max(0, min(int(layout.q_lens[i]), len(prompt) - start - 1))
            first_row = int(layout.logits_start[i])
            spans.append((len(row_ids), count))
            row_ids.extend(range(first_row, first_row + count))
            targets.extend(prompt[start + 1 : start + 1 + count])
        dev = logits.device
        logprobs = torch.log_softmax(logits.index_select(0, torch.tensor(row_ids, dtype=torch.int64, device=dev)), -1)
        chosen = logprobs.gather(1, torch.tensor(targets, dtype=torch.int64, device=dev)[:, None])[:, 0].tolist()
        k_max = max(states[i].spec.prompt_logprobs for i in which)
        top_vals = top_ids = None
        if k_max > 0 and row_ids:
            vals, ids = torch.topk(logprobs, min(k_max, logprobs.shape[1]), dim=-1)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        out = []
        for i, (at, count) in zip(which, spans):
            k = states[i].spec.prompt_logprobs
            top = None
            if k >= 0:
                top = [
                    list(zip(top_ids[r][:k], top_vals[r][:k])) if k > 0 else [] for r in range(at, at + count)
                ]
            out.append(
                PromptLogprobs(
                    seq_id=seqs[i].seq_id,
                    first_pos=int(layout.start_pos[i]) + 1,
                    logprobs=chosen[at : at + count],
                    top_logprobs=top,
                )
            )
        return out


@functools.cache
def _keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of handing it back to the OS at once.

    Each forward allocates and frees multi-megabyte temporaries; with glibc's defaults these are
    mmap'ed or trimmed on free, and every reuse pays page faults that cost up to 10x the arithmetic
    (measured on rms_norm over 1024 tokens). The price is a process that keeps its peak heap. A no-op
    where glibc's mallopt is not available.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = mallopt(m_mmap_threshold, 32 << 20)  # the largest value glibc accepts
    return bool(ok and mallopt(m_trim_threshold, 1 << 30))
