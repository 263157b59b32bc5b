"""What one step's output does to the sequences it ran: KV now computed, tokens appended, stop rules applied."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraledger.actors.messages import RequestTiming, SeqUpdate
from loraledger.scheduling.batch_state import BatchState
from loraledger.scheduling.block_manager import BlockManager
from loraledger.scheduling.request_state import SeqStatus
from loraledger.scheduling.step_plan import StepOutput
from loraledger.scheduling.stop_rules import check_stop

if TYPE_CHECKING:
    pass


@dataclass
class StepResult:
    """SchedulingPolicy.update's answer: for the output side, and what the engine puts on record."""

    updates: list[SeqUpdate] = field(default_factory=list)  # each sequence's new token (finish_reason once it ends)
    timings: list[RequestTiming] = field(
        default_factory=list
    )  # first scheduled, cached tokens, preempted, prompt logprobs
    preempted: list[tuple[str, int]] = field(default_factory=list)  # (audit id, sequence index) preempted for this step
    failed: list[tuple[str, Exception]] = field(
        default_factory=list
    )  # (audit id, error): requests that fail, each alone
    time: float = field(default_factory=time.time)


def apply_output(
    step, output: StepOutput, batch: BatchState, blocks: BlockManager, max_model_len: int, result
) -> set[str]:
    """Fill result.updates and result.timings from a ScheduledStep's output; the audit ids whose grammar refused a
    token (their updates are left out: each of those requests fails)."""
    timings: dict[str, RequestTiming] = {
        audit_id: RequestTiming(audit_id=audit_id, preempted=True) for audit_id, _ in result.preempted
    }
    sampled = {s.seq_id: s for s in output.sampled}
    prompt_lps = {p.seq_id: p for p in output.prompt_logprobs}
    updates: list[SeqUpdate] = []
    refused: set[str] = set()
    for work in step.plan.seqs:
        seq = batch.seqs.get(work.seq_id)
        if seq is None or seq.status is not SeqStatus.RUNNING:
            continue  # aborted or stopped while the step ran (a step planned ahead: ended by the one before)
        req = seq.request
        rid = req.audit_id
        if work.sample:
            seq.pending -= 1
        seq.num_computed = work.start_pos + len(work.token_ids)
        blocks.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed, req.prefix_salt)
        lp = prompt_lps.get(seq.seq_id)
        if not req.timing_sent or lp is not None:
            req.timing_sent = True
            timings[rid] = RequestTiming(
                audit_id=rid,
                first_scheduled_time=req.first_scheduled_time,
                num_cached_tokens=req.num_cached_tokens,
                preempted=rid in timings and timings[rid].preempted,
                prompt_logprobs=None if lp is None else [lp.first_pos, lp.logprobs, lp.top_logprobs, lp.ranks],
            )
        if seq.num_computed >= req.prompt_len and seq.spec.prompt_logprobs >= 0:
            req.prompt_logprobs_done = True
        token = sampled.get(seq.seq_id)
        if token is None:
            continue
        if token.grammar_refused:
            refused.add(rid)
            continue
        seq.token_ids.append(token.token_id)
        finish, stop_reason = check_stop(seq, token.token_id, max_model_len, token.grammar_done)
        updates.append(
            SeqUpdate(
                audit_id=rid,
                seq_index=seq.index,
                token_ids=[token.token_id],
                logprobs=[token.logprob],
                top_logprobs=None if token.top_logprobs is None else [token.top_logprobs],
                finish_reason=finish,
                stop_reason=stop_reason,
                ranks=None if token.rank is None else [token.rank],
            )
        )
        if finish is not None:
            batch.running.remove(seq)
            batch.finish(seq)
    result.updates = [u for u in updates if u.audit_id not in refused] if refused else updates
    result.timings = list(timings.values())
    return refused
