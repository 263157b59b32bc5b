"""A step's plan from the work the policy chose: new sequences announced, token chunks, block tables, adapter slots."""

from __future__ import annotations

import time
from collections.abc import Callable

from loraledger.lora.slot_table import SlotTable
from loraledger.scheduling.block_manager import BlockManager
from loraledger.scheduling.request_state import Seq
from loraledger.scheduling.step_plan import PENDING_TOKEN, NewSeq, SeqWork, SlotLoad, StepPlan


def assign_slots(
    slots: SlotTable, fingerprints: set[str], step: int, keep: set[str], checkpoint_for: Callable[[str], object]
) -> list[SlotLoad]:
    """Slots for the adapters of a step; the loads the executor must make first. `keep`: adapters with running
    sequences, whose slots are not taken even if they are not in this step."""
    loads = []
    for fp in sorted(fingerprints):  # sorted: a deterministic slot layout for the same batch
        if slots.touch(fp, step):
            continue
        ckpt = checkpoint_for(fp)
        slot = slots.assign(fp, getattr(ckpt, "name", None) or fp[:12], step, keep | fingerprints)
        loads.append(SlotLoad(slot=slot, fingerprint=fp, checkpoint=ckpt))
    return loads


def build_plan(
    step_id: int,
    work: list[tuple[Seq, int]],
    blocks: BlockManager,
    slots: SlotTable,
    slot_loads: list[SlotLoad],
    freed_seq_ids: list[int],
) -> StepPlan:
    """The plan of `work` ((sequence, tokens to run) pairs, their blocks allocated and adapters in a slot); marks
    the sequences announced and scheduled."""
    new_seqs = []
    seq_work = []
    now = time.time()
    for seq, num_new in work:
        req = seq.request
        if not seq.announced:
            seq.announced = True
            new_seqs.append(
                NewSeq(
                    seq_id=seq.seq_id,
                    sampling=seq.spec,
                    prompt_token_ids=seq.token_ids[: req.prompt_len],
                    grammar=req.grammar,
                )
            )
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        start, end = seq.num_scheduled, seq.num_scheduled + num_new
        token_ids = seq.token_ids[start:end]
        if end > len(seq.token_ids):  # the token the step in flight samples: at most one, the last
            token_ids.append(PENDING_TOKEN)
        sample = end == len(seq.token_ids) + seq.pending
        fp = req.adapter_fingerprint
        seq_work.append(
            SeqWork(
                seq_id=seq.seq_id,
                token_ids=token_ids,
                start_pos=start,
                block_table=blocks.block_table(seq.seq_id),
                lora_slot=slots.slot_of(fp) if fp else -1,
                sample=sample,
                prompt_logprobs=seq.spec.prompt_logprobs >= 0
                and not req.prompt_logprobs_done
                and start < req.prompt_len,
            )
        )
        seq.num_scheduled = end
        if sample:
            seq.pending += 1
    return StepPlan(
        step_id=step_id, seqs=seq_work, new_seqs=new_seqs, freed_seq_ids=freed_seq_ids, slot_loads=slot_loads
    )
