"""ModelRunner: owns weights, KV cache, adapter slots and sampling state; executes one StepPlan at a time."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from loraledger.errors import ConfigError, EngineDeadError, InternalError, LoRADisabledError
from loraledger.gpu import base_model
from loraledger.gpu.cuda_graphs import DecodeGraphs
from loraledger.gpu.forward_batch import BatchLayout, build_forward_batch, decode_layout, order_for_batch
from loraledger.gpu.grammar_mask import GrammarMask
from loraledger.gpu.heap import hand_back_freed_memory
from loraledger.gpu.kv_cache import KVCache
from loraledger.gpu.model import Model
from loraledger.gpu.ops import Ops
from loraledger.gpu.sampler import SampleJob, Sampler, SampleRow
from loraledger.gpu.transfer import to_device
from loraledger.logging import get_logger
from loraledger.lora.device_slots import LoraSlots
from loraledger.quantization.scheme import QuantScheme
from loraledger.scheduling.step_plan import (
    PENDING_TOKEN,
    PromptLogprobs,
    SampledToken,
    SamplingSpec,
    SeqWork,
    StepOutput,
    StepPlan,
)


@dataclass
class SeqState:
    """A sequence's sampling settings and token history, kept from its NewSeq until it is freed.

    num_output counts every token sampled for the sequence, including those of launched steps whose
    ids are still on the device; output_token_ids holds the ids read back so far (in order).
    """

    spec: SamplingSpec
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_output: int = 0
    matcher: object = None  # xgrammar GrammarMatcher of a constrained sequence: it has accepted output_token_ids
    # the grammar refused a sampled id: the request's other masks (allowed_token_ids, bad_words) left none of the
    # tokens it allows, so the sampler picked among tokens all masked; the request fails (alone), nothing follows
    refused: bool = False

    def accept(self, token: int) -> bool:
        """Append a sampled id (and feed it to the grammar); True when the grammar is complete with it."""
        self.output_token_ids.append(token)
        if self.matcher is None or self.matcher.is_terminated() or self.refused:
            return False
        if not self.matcher.accept_token(token):
            self.refused = True
            return False
        return self.matcher.is_terminated()


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device: launch() returns it, finish() turns it into a StepOutput.

    Its sampled token ids stay on the device (job.tokens) so that the next step can take its inputs
    from them; rows_of maps each sampled sequence to its row there.
    """

    step_id: int
    seq_ids: list[int]  # sampled rows, in row order
    rows_of: dict[int, int]
    job: SampleJob | None
    prompt: _PromptLogprobJob | None
    prepare_seconds: float
    forward_seconds: float
    # CUDA: (start, end) around the step's device work, and the previous step's end (for the idle time between)
    events: tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event | None] | None
    settled: bool = False  # the sampled ids are in the sequences' output_token_ids
    grammar_done: set[int] = field(default_factory=set)  # sequences whose grammar completed with this step's token
    grammar_refused: set[int] = field(
        default_factory=set
    )  # sequences whose grammar refused this step's token (SeqState.refused)


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
        cuda_graph_max_len: int | None = None,
        quantization: QuantScheme | None = None,
    ) -> None:
        """cuda_graph_max_batch > 0 (CUDA only): decode steps of up to that many sequences replay CUDA graphs
        (gpu/cuda_graphs.py) instead of launching each kernel from Python; a step with a sequence whose context is
        longer than cuda_graph_max_len (EngineArgs.max_seq_len_to_capture; default max_model_len) runs eagerly."""
        self.config = base_model.read_config(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        self.ops = ops
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_cache = KVCache(self.config, num_kv_blocks, block_size, dtype, self.device)
        self.lora_slots = None
        if enable_lora:
            layout = ops.lora_b_layout(dtype, self.device)
            self.lora_slots = LoraSlots(self.config, max_loras, max_lora_rank, dtype, self.device, layout=layout)
        weights = base_model.load_base(
            model_dir, self.config, dtype=dtype, device=self.device, quantization=quantization
        )
        # quantized projections no packed kernel takes, dequantized at load: logged, never silent (the record's
        # quantization stays the checkpoint's, which is unchanged)
        self.dequantized_projections = list(weights.dequantized)
        if weights.dequantized:
            get_logger("model_runner").warning(
                "quantized projections dequantized at load to the model dtype (no packed kernel takes them)",
                quantization=None if quantization is None else quantization.describe(),
                device=str(self.device),
                dtype=str(dtype),
                count=len(weights.dequantized),
                projections=weights.dequantized,
            )
        self.model = Model(self.config, weights, ops, lora_slots=self.lora_slots)
        del weights  # the plain weights the pre-packed copies replaced
        self.sampler = Sampler(self.config.vocab_size, self.device)
        self.grammar_mask = GrammarMask(self.config.vocab_size)
        if self.device.type == "cpu":
            hand_back_freed_memory()  # after the last allocation of the load
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
                max_model_len=cuda_graph_max_len or max_model_len or self.config.max_position_embeddings,
                block_size=block_size,
                device=self.device,
            )
        self._seqs: dict[int, SeqState] = {}
        self._unfinished: deque[LaunchedStep] = deque()  # launched, not yet finished, oldest first
        self._last_end: torch.cuda.Event | None = None  # end of the last launched step's device work
        self._lost: set[int] = set()  # sequences of a step whose launch failed: their pending tokens never came
        self._previous: LaunchedStep | None = None  # the step launched last (finished or not): PENDING_TOKEN's source
        self._closed = False

    @property
    def num_live_seqs(self) -> int:
        return len(self._seqs)

    def close(self) -> None:
        """Drop every tensor (weights, KV cache, adapter slots, sampler state); execute() fails afterwards.

        The Executor calls this on the event loop when it stops. Otherwise the last reference to the
        runner can be a worker thread's after its last step; if that thread lets go while the
        interpreter is finalizing, torch's tensor deallocation releases and retakes the GIL, Python
        ends the thread with a forced unwind through C++ frames, and the process aborts ("terminate
        called without an active exception", exit code 134) after all its work is done. Closing here
        leaves such a reference holding an empty object.
        """
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self.model = None
        self.ops = None  # TorchOps keeps a KV workspace tensor between steps
        self.kv_cache = None
        self.lora_slots = None
        self.sampler = None
        self.grammar_mask = None
        self._seqs.clear()
        self._unfinished.clear()
        self._previous = None
        self._last_end = None
        self._closed = True

    def execute(self, plan: StepPlan) -> StepOutput:
        """Apply the plan's slot and sequence changes, run one forward over its sequences, sample."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Queue one step's work on the device and return without waiting for it.

        The plan may use the tokens of the step launched just before it (PENDING_TOKEN): they are
        taken from that step's device tensor. Steps must be finished in the order they were launched.
        If that step's launch failed, its sequences (failed with it) are dropped from this one.
        """
        if self._closed:
            raise EngineDeadError("the model runner was closed (the engine shut down); start a new engine")
        lost, self._lost = self._lost, set()
        try:
            with torch.inference_mode():
                return self._launch(plan, lost)
        except BaseException:
            self._lost = {s.seq_id for s in plan.seqs}
            self._previous = None
            raise

    def _launch(self, plan: StepPlan, lost: set[int]) -> LaunchedStep:
        t0 = time.perf_counter()
        self._apply_slot_changes(plan)
        for seq_id in plan.freed_seq_ids:
            self._seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            state = SeqState(new.sampling, list(new.prompt_token_ids), num_output=len(new.output_token_ids))
            if new.grammar is not None:
                state.matcher = new.grammar.matcher()
            for token in new.output_token_ids:  # a recomputed sequence: its grammar state is rebuilt from its outputs
                state.accept(token)
            self._seqs[new.seq_id] = state
        work = [s for s in plan.seqs if s.seq_id not in lost or not s.token_ids or s.token_ids[-1] != PENDING_TOKEN]
        if not work:
            step = LaunchedStep(plan.step_id, [], {}, None, None, time.perf_counter() - t0, 0.0, None)
            self._unfinished.append(step)
            self._previous = step
            return step
        seqs, num_decode = order_for_batch(work)
        states = self._check(seqs)
        pending = self._pending_sources(seqs)
        if any(s.sample and (st.spec.needs_history or st.matcher is not None) for s, st in zip(seqs, states)):
            # penalties read earlier outputs' values, and a grammar's mask follows from them: wait for the ids
            # still on the device (a step planned ahead runs, but its constrained rows' masks wait for the one before)
            self._settle_all()
        logits = None
        if self.graphs is not None and num_decode == len(seqs) and self.graphs.accepts(seqs):
            layout = decode_layout(seqs)
            patch = None if pending is None else (to_device(pending[0], torch.int64, self.device), pending[1])
            t1 = time.perf_counter()
            events = self._start_events()
            logits = self.graphs.run(seqs, patch)
        if logits is None:
            batch, layout = build_forward_batch(
                seqs,
                num_decode,
                block_size=self.block_size,
                device=self.device,
                ops=self.ops,
                lora_slots=self.lora_slots,
            )
            if pending is not None:
                rows = layout.token_start[pending[0]] + layout.q_lens[pending[0]] - 1
                batch.input_ids.index_copy_(0, to_device(rows, torch.int64, self.device), pending[1])
            t1 = time.perf_counter()
            events = self._start_events()
            logits = self.model.forward(batch, self.kv_cache)
        job, seq_ids = self._sample(seqs, states, layout, logits)
        prompt = self._prompt_logprobs(seqs, states, layout, logits)
        if events is not None:
            events[1].record()
            self._last_end = events[1]
        step = LaunchedStep(
            plan.step_id,
            seq_ids,
            {sid: i for i, sid in enumerate(seq_ids)},
            job,
            prompt,
            t1 - t0,
            time.perf_counter() - t1,
            events,
        )
        self._unfinished.append(step)
        self._previous = step
        return step

    def finish(self, step: LaunchedStep) -> StepOutput:
        """Wait for a launched step's results (the oldest unfinished one) and return them."""
        if not self._unfinished or self._unfinished[0] is not step:
            raise InternalError(
                f"step {step.step_id} is finished out of order: steps finish in the order they were launched"
            )
        t0 = time.perf_counter()
        try:
            self._settle(step)
        finally:
            self._unfinished.popleft()  # a step that raises is over too (its requests fail): the next ones finish after it
        sampled = []
        if step.job is not None:
            out = step.job.result()
            ranks = out.ranks or [None] * len(step.seq_ids)
            sampled = [
                SampledToken(
                    sid,
                    out.token_ids[j],
                    out.logprobs[j],
                    out.top_logprobs[j],
                    ranks[j],
                    sid in step.grammar_done,
                    sid in step.grammar_refused,
                )
                for j, sid in enumerate(step.seq_ids)
            ]
        prompt_lps = [] if step.prompt is None else step.prompt.result()
        gpu_seconds = idle = None
        if step.events is not None:
            start, end, before = step.events
            gpu_seconds = start.elapsed_time(end) / 1e3
            idle = max(0.0, before.elapsed_time(start) / 1e3) if before is not None else None
        return StepOutput(
            step_id=step.step_id,
            sampled=sampled,
            prompt_logprobs=prompt_lps,
            forward_seconds=step.forward_seconds + (time.perf_counter() - t0),
            prepare_seconds=step.prepare_seconds,
            gpu_seconds=gpu_seconds,
            gpu_idle_seconds=idle,
        )

    def _start_events(self):
        """CUDA: events around the step's device work (start recorded now, once the inputs are built), with the
        previous step's end event, so that finish() can tell the device time and the idle time before it."""
        if self.device.type != "cuda":
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end, self._last_end

    def _pending_sources(self, seqs: list[SeqWork]) -> tuple[np.ndarray, torch.Tensor] | None:
        """For the sequences whose last token is PENDING_TOKEN: (their indices in seqs, their token ids on the device),
        taken from the step launched just before this one."""
        which = [i for i, s in enumerate(seqs) if s.token_ids and s.token_ids[-1] == PENDING_TOKEN]
        if not which:
            return None
        prev = self._previous
        rows = []
        for i in which:
            row = None if prev is None else prev.rows_of.get(seqs[i].seq_id)
            if row is None:
                before = (
                    "no step was launched before it"
                    if prev is None
                    else f"step {prev.step_id}, launched before it, did not sample it"
                )
                raise InternalError(
                    f"sequence {seqs[i].seq_id} runs the token the previous step samples (PENDING_TOKEN), but {before}"
                )
            rows.append(row)
        src = prev.job.tokens.index_select(0, to_device(rows, torch.int64, self.device))
        return np.asarray(which, dtype=np.int64), src

    def _settle(self, step: LaunchedStep) -> None:
        """Read a launched step's sampled ids back (waiting for the device) into its sequences' histories."""
        if step.settled:
            return
        step.settled = True
        if step.job is None:
            return
        for sid, token in zip(step.seq_ids, step.job.result().token_ids):
            state = self._seqs.get(sid)
            if state is None:  # freed meanwhile (aborted or stopped while the step ran)
                continue
            if state.accept(token):
                step.grammar_done.add(sid)
            elif state.refused:
                step.grammar_refused.add(sid)

    def _settle_all(self) -> None:
        for step in self._unfinished:
            self._settle(step)

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
            raise InternalError(
                f"the step has {total} tokens, above max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        states = []
        for s in seqs:
            state = self._seqs.get(s.seq_id)
            if state is None:
                raise InternalError(
                    f"sequence {s.seq_id} is scheduled but was never announced in a NewSeq (or was freed)"
                )
            if s.lora_slot >= 0:
                if self.lora_slots is None:
                    raise LoRADisabledError(
                        f"sequence {s.seq_id} uses adapter slot {s.lora_slot}, but LoRA is disabled"
                    )
                if self.lora_slots.fingerprints[s.lora_slot] is None:
                    raise InternalError(f"sequence {s.seq_id} uses adapter slot {s.lora_slot}, which holds no adapter")
            states.append(state)
        return states

    def _sample(
        self, seqs: list[SeqWork], states: list[SeqState], layout: BatchLayout, logits: torch.Tensor
    ) -> tuple[SampleJob | None, list[int]]:
        which = np.nonzero(layout.sample_row >= 0)[0].tolist()
        if not which:
            return None, []
        rows = [
            SampleRow(
                states[i].spec,
                states[i].prompt_token_ids,
                states[i].output_token_ids,
                states[i].num_output,
                constrained=states[i].matcher is not None,
            )
            for i in which
        ]
        for i in which:
            states[i].num_output += 1
        row_idx = to_device(layout.sample_row[which], torch.int64, logits.device)
        picked = logits.index_select(0, row_idx).float()
        # constrained rows: the grammar's mask, for the whole batch in one call; logprobs then report the constrained distribution
        self.grammar_mask.apply(picked, [states[i].matcher for i in which])
        job = self.sampler.sample_async(picked, rows)
        return job, [seqs[i].seq_id for i in which]

    def _prompt_logprobs(
        self, seqs: list[SeqWork], states: list[SeqState], layout: BatchLayout, logits: torch.Tensor
    ) -> _PromptLogprobJob | None:
        which = [i for i, s in enumerate(seqs) if s.prompt_logprobs]
        if not which:
            return None
        # logits row j of a chunk scores the prompt token at position start_pos + j + 1
        row_ids, targets, spans = [], [], []
        for i in which:
            prompt = states[i].prompt_token_ids
            start = int(layout.start_pos[i])
            count = max(0, min(int(layout.q_lens[i]), len(prompt) - start - 1))
            first_row = int(layout.logits_start[i])
            spans.append(
                (seqs[i].seq_id, int(layout.start_pos[i]) + 1, len(targets), count, states[i].spec.prompt_logprobs)
            )
            row_ids.extend(range(first_row, first_row + count))
            targets.extend(prompt[start + 1 : start + 1 + count])
        dev = logits.device
        logprobs = torch.log_softmax(logits.index_select(0, to_device(row_ids, torch.int64, dev)), -1)
        chosen = logprobs.gather(1, to_device(targets, torch.int64, dev)[:, None])[:, 0]
        ranks = (logprobs >= chosen[:, None]).sum(dim=-1)  # vLLM's rank of each prompt token (1: the most likely)
        k_max = max(states[i].spec.prompt_logprobs for i in which)
        top = None
        if k_max > 0 and row_ids:
            top = torch.topk(logprobs, min(k_max, logprobs.shape[1]), dim=-1)
        return _PromptLogprobJob(spans, chosen, top, ranks)


class _PromptLogprobJob:
    """A step's prompt logprobs, still on the device; result() reads them back (after the step's sampled ids)."""

    def __init__(
        self, spans: list[tuple[int, int, int, int, int]], chosen: torch.Tensor, top, ranks: torch.Tensor
    ) -> None:
        self._spans = spans  # (seq_id, first position, first row, rows, k)
        self._chosen = chosen
        self._top = top
        self._ranks = ranks

    def result(self) -> list[PromptLogprobs]:
        chosen = self._chosen.tolist()
        ranks = self._ranks.tolist()
        top_vals = top_ids = None
        if self._top is not None:
            top_vals, top_ids = self._top.values.tolist(), self._top.indices.tolist()
        out = []
        for seq_id, first_pos, at, count, k in self._spans:
            top = None
            if k >= 0:
                top = [list(zip(top_ids[r][:k], top_vals[r][:k])) if k > 0 else [] for r in range(at, at + count)]
            out.append(
                PromptLogprobs(
                    seq_id=seq_id,
                    first_pos=first_pos,
                    logprobs=chosen[at : at + count],
                    top_logprobs=top,
                    ranks=ranks[at : at + count],
                )
            )
        return out
