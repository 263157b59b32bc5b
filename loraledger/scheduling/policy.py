"""SchedulingPolicy: continuous batching over the paged KV cache, adapter slots, preemption and stop checks, as calls.

A plain synchronous object (no event loop, no channels): `add` and `abort` requests, `schedule()` the next
step's plan, `update()` with that step's output to learn which sequences got which tokens, what finished and
what failed. The scheduler actor drives it; tests and the slot simulator call it directly.

Requests join and leave the running batch at step boundaries; prefills (chunked to the token budget) and
decodes share a step; when KV blocks run out the youngest running sequence is preempted and later recomputed
(its output is unchanged: the sampler's randomness is keyed by (seed, position), not by batch). At most
max_loras distinct adapters run in a step; a request whose adapter cannot get a slot waits, and once it has
waited at the head of the queue for `max_head_skips` steps, one running adapter takes no new requests so its
slot frees for it. Seats are shared fairly between requests (scheduling/fair_seats.py).

Overlapped scheduling: `schedule(ahead=True)` plans a step while earlier ones are in flight, each sequence
they sample taking PENDING_TOKEN as its input. A plan made ahead never preempts: when KV blocks run short or a
fair seat needs a preemption it returns None, and the step is planned once the steps in flight are back. What
those steps' tokens decide is settled in `update`: a sequence that stops there had one step's work too many,
which is dropped.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from loraledger.actors.messages import NewRequest
from loraledger.errors import InternalError, RequestFailedError, StructuredOutputError
from loraledger.logging import get_logger, request_logger
from loraledger.lora.slot_table import SlotTable
from loraledger.scheduling import fair_seats
from loraledger.scheduling.batch_state import BatchState
from loraledger.scheduling.block_manager import BlockManager
from loraledger.scheduling.plan_builder import assign_slots, build_plan
from loraledger.scheduling.request_intake import RequestIntake
from loraledger.scheduling.request_state import Seq, SeqStatus
from loraledger.scheduling.scheduler_config import SchedulerConfig
from loraledger.scheduling.step_plan import StepOutput, StepPlan
from loraledger.scheduling.step_update import StepResult, apply_output
from loraledger.scheduling.stop_rules import ends_in_flight


@dataclass
class ScheduledStep:
    """A plan and the sequences preempted to make room for it (reported once its output is back)."""

    plan: StepPlan
    preempted: list[Seq] = field(default_factory=list)


class SchedulingPolicy:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.slots = SlotTable(config.max_loras)
        self._batch = BatchState(self.blocks)
        self._intake = RequestIntake(config)
        self._step_id = 0
        self._draining: str | None = None  # adapter taking no new requests so a starved head gets its slot
        self._yielded_from: set = set()  # requests that gave a seat up in this step (fair share)
        self._log = get_logger("scheduler")

    # --- requests -----------------------------------------------------------------------------

    def add(self, request: NewRequest) -> None:
        """Queue a NewRequest's sequences. Raises (and holds nothing of it) when the request cannot be built."""
        self._batch.enter(self._intake.make(request))

    def abort(self, audit_ids: list[str]) -> list[tuple[str, int]]:
        """End these requests' unfinished sequences; the (audit id, sequence index) of each one ended."""
        ended = []
        for rid in audit_ids:
            req = self._batch.requests.get(rid)
            if req is None:
                continue
            for seq in req.seqs:
                if seq.status is not SeqStatus.FINISHED:
                    self._batch.end(seq)
                    ended.append((rid, seq.index))
        return ended

    def stop(self, audit_id: str, seq_index: int) -> None:
        """A stop string ended this sequence (the output side saw it): compute no more of it."""
        req = self._batch.requests.get(audit_id)
        if req is None:
            return
        for seq in req.seqs:
            if seq.index == seq_index and seq.status is not SeqStatus.FINISHED:
                self._batch.end(seq)

    def fail(self, audit_id: str) -> bool:
        """End every sequence of a request that fails; False when the policy does not hold it."""
        req = self._batch.requests.get(audit_id)
        if req is None:
            return False
        for seq in req.seqs:
            if seq.status is not SeqStatus.FINISHED:
                self._batch.end(seq)
        self._batch.requests.pop(audit_id, None)
        return True

    def abandon_all(self) -> list[str]:
        """The audit ids of every request held, forgotten (the engine is stopping: each fails)."""
        ids = list(self._batch.requests)
        self._batch.requests.clear()
        return ids

    def pin(self, fingerprint: str, checkpoint: object) -> None:
        self.slots.pin(fingerprint, checkpoint)

    def unpin(self, fingerprint: str) -> None:
        self.slots.unpin(fingerprint)

    def has_request(self, audit_id: str) -> bool:
        return audit_id in self._batch.requests

    def queue_state(self) -> dict:
        """The queues and the slot counters, as the engine's stats report them."""
        return {
            **self._batch.queue_state(),
            "max_loras": self.slots.num_slots,
            "slot_loads": dict(self.slots.loads),
            "slot_evictions": dict(self.slots.evictions),
        }

    # --- scheduling ---------------------------------------------------------------------------

    def schedule(self, ahead: bool = False) -> ScheduledStep | None:
        """The next step, or None when there is nothing to run (or, `ahead`, nothing to run without preempting).

        ahead: steps are in flight, whose sampled tokens are not known yet (they become PENDING_TOKEN inputs).
        """
        budget = self.config.max_num_batched_tokens
        work: list[tuple[Seq, int]] = []
        active_fps: set[str] = set()
        preempted: list[Seq] = []
        if ahead:
            if self._seat_victims():
                return None  # a fair seat needs a preemption: plan it once the steps in flight are back
            self._yielded_from.clear()
            yielded: list[Seq] = []
        else:
            yielded = self._make_room_for_waiting()  # fair share: seats for requests that have none

        running = list(self._batch.running)
        i = 0
        while i < len(running):
            seq = running[i]
            if seq.status is not SeqStatus.RUNNING or self._ends_in_flight(seq):
                i += 1
                continue
            num_new = min(len(seq.token_ids) + seq.pending - seq.num_scheduled, budget)
            if num_new <= 0:
                i += 1
                continue
            if ahead and not self.blocks.can_allocate(seq.seq_id, seq.num_scheduled + num_new):
                return None  # short of KV blocks: plan once the steps in flight are back, preempting then
            while not self.blocks.can_allocate(seq.seq_id, seq.num_scheduled + num_new):
                victim = self._batch.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            self.blocks.allocate(seq.seq_id, seq.num_scheduled + num_new)
            work.append((seq, num_new))
            if seq.request.adapter_fingerprint:
                active_fps.add(seq.request.adapter_fingerprint)
            budget -= num_new
            i += 1
            if budget <= 0:
                break

        if not preempted:
            self._admit_waiting(work, active_fps, budget)

        if not work:
            return None
        return ScheduledStep(self._build_plan(work), yielded + preempted)

    def _ends_in_flight(self, seq: Seq) -> bool:
        return ends_in_flight(seq, self.config.max_model_len)

    def _admit_waiting(self, work: list[tuple[Seq, int]], active_fps: set[str], budget: int) -> None:
        """Move waiting sequences into the running set while seats, tokens and KV blocks last.

        Fair across requests: waiting sequences are taken round-robin by request, first for requests that hold
        no seat, then for those below their share of the seats, then for anyone.
        """
        batch = self._batch
        max_num_seqs = self.config.max_num_seqs
        if not batch.waiting or budget <= 0 or len(batch.running) >= max_num_seqs:
            return
        seats = Counter(s.request for s in batch.running)
        share = self._fair_share()
        admitted: list[Seq] = []
        head_blocked = False  # the first sequence considered waits for an adapter slot
        head_seen = False
        draining: str | None = None
        stop = False
        order = list(fair_seats.round_robin(batch.waiting))
        for cap in (1, share, None):  # seatless requests first, then those below their share, then anyone
            for seq in order:
                if stop or budget <= 0 or len(batch.running) >= max_num_seqs:
                    break
                req = seq.request
                fp = req.adapter_fingerprint
                if seq.status is not SeqStatus.WAITING:
                    continue  # admitted in an earlier pass
                if cap is not None and seats[req] >= cap:
                    continue
                if cap is None and req in self._yielded_from:
                    continue  # it just gave a seat up for a request with none: not back in the same step
                if (
                    seq.index > 0
                    and not req.seqs[0].num_computed >= req.prompt_len
                    and req.seqs[0].status is not SeqStatus.FINISHED
                ):
                    # siblings of n > 1 wait for the first sequence's prompt, then reuse its cached blocks
                    head_seen = True
                    continue
                is_head, head_seen = not head_seen, True
                if fp and not self._slot_available(fp, active_fps):
                    if is_head and not head_blocked:
                        head_blocked = True
                        req.blocked_steps += 1
                        if req.blocked_steps > self.config.max_head_skips:
                            # the head has waited long enough: one running adapter takes no new requests,
                            # so its slot frees within one request's length and the head gets it next;
                            # the other slots keep the batch full meanwhile
                            draining = self._drain_target()
                            if draining is None:
                                stop = True
                                break
                    continue
                if draining is not None and fp == draining:
                    continue
                use_cache = seq.spec.prompt_logprobs < 0 or req.prompt_logprobs_done
                prefix_blocks, cached = (
                    self.blocks.lookup_prefix(seq.token_ids, req.prefix_salt) if use_cache else ([], 0)
                )
                num_new = min(len(seq.token_ids) - cached, budget)
                if not self.config.chunked_prefill and num_new < len(seq.token_ids) - cached:
                    stop = True  # enable_chunked_prefill=False: the prompt waits for a step with room for all of it
                    break
                if not self.blocks.can_allocate(seq.seq_id, cached + num_new, prefix_blocks):
                    stop = True  # out of KV blocks: admitting later (smaller) requests first would starve this one
                    break
                self.blocks.allocate(seq.seq_id, cached + num_new, prefix_blocks)
                seq.num_computed = seq.num_scheduled = cached
                batch.start_running(seq)
                if req.num_cached_tokens is None:
                    req.num_cached_tokens = cached
                if fp:
                    active_fps.add(fp)
                work.append((seq, num_new))
                budget -= num_new
                seats[req] += 1
                admitted.append(seq)
        if admitted:
            batch.leave_waiting(admitted)

    def _fair_share(self) -> int:
        return fair_seats.fair_share(self.config.max_num_seqs, len(self._batch.requests))

    def _seat_victims(self) -> list[Seq]:
        def can_run(req) -> bool:
            fp = req.adapter_fingerprint
            return not fp or self._slot_available(fp, set())

        return fair_seats.seat_victims(
            self._batch.running, self._batch.waiting, self.config.max_num_seqs, self._fair_share(), can_run
        )

    def _make_room_for_waiting(self) -> list[Seq]:
        """Preempt the fair-seat victims (they go back to the queue, recomputed later with an unchanged output)."""
        self._yielded_from.clear()  # one step's worth
        victims = self._seat_victims()
        for victim in victims:
            self._preempt(victim)
            self._yielded_from.add(victim.request)
        return victims

    def _drain_target(self) -> str | None:
        """The running adapter to stop feeding so a slot frees: the one closest to done, kept until it is."""
        remaining: dict[str, int] = {}
        for s in self._batch.running:
            fp = s.request.adapter_fingerprint
            if fp and not self.slots.is_pinned(fp):
                remaining[fp] = max(remaining.get(fp, 0), s.request.max_output - s.num_output)
        if self._draining not in remaining:
            self._draining = min(remaining, key=remaining.__getitem__) if remaining else None
        return self._draining

    def _slot_available(self, fp: str, active_fps: set[str]) -> bool:
        """Can fp run in this step? Slots are free to reassign except those of running or pinned adapters."""
        if fp in active_fps:
            return True
        needed = self._running_fingerprints() | active_fps | {fp}
        needed.discard("")
        return self.slots.fits(needed)

    def _running_fingerprints(self) -> set[str]:
        return {s.request.adapter_fingerprint for s in self._batch.running}

    def _preempt(self, seq: Seq) -> None:
        self._batch.preempt(seq)
        req = seq.request
        log = request_logger(self._log, req.audit_id, req.lora_request and req.lora_request.lora_name)
        log.info("preempted for recompute", seq_index=seq.index, tokens=len(seq.token_ids))

    def _build_plan(self, work: list[tuple[Seq, int]]) -> StepPlan:
        fps = {seq.request.adapter_fingerprint for seq, _ in work if seq.request.adapter_fingerprint}
        loads = assign_slots(self.slots, fps, self._step_id, self._running_fingerprints(), self._checkpoint_for)
        self._step_id += 1
        return build_plan(self._step_id, work, self.blocks, self.slots, loads, self._batch.take_freed())

    def _checkpoint_for(self, fp: str):
        pinned = self.slots.pinned_checkpoint(fp)
        if pinned is not None:
            return pinned
        for req in self._batch.requests.values():
            if req.adapter_fingerprint == fp:
                return req.checkpoint
        raise InternalError(f"a step needs adapter {fp[:12]}, but no request or pin holds its checkpoint")

    # --- after a step -------------------------------------------------------------------------

    def update(self, step: ScheduledStep, output: StepOutput | None, error: object = None) -> StepResult:
        """Take in what a step computed (or the error it raised): the tokens of each sequence, which requests
        finished, which failed (each alone; the policy no longer holds them)."""
        result = StepResult(preempted=[(s.request.audit_id, s.index) for s in step.preempted])
        if error is not None or output is None:
            self._fail_step(step.plan, error, result)
            return result
        refused = apply_output(step, output, self._batch, self.blocks, self.config.max_model_len, result)
        for rid in refused:
            req = self._batch.requests.get(rid)
            if req is None:
                continue
            self.fail(rid)
            result.failed.append((rid, StructuredOutputError(
                f"request {req.shown_id}: its structured_outputs allow none of the tokens its other sampling "
                "parameters leave (allowed_token_ids, bad_words) at this point of the output; loosen one of them"
            )))  # fmt: skip
        return result

    def _fail_step(self, plan: StepPlan, error: object, result: StepResult) -> None:
        """A step raised: its requests fail (on record), the engine and every other request go on.

        A step planned ahead of this one may hold the same sequences: finished here, their results there are dropped.
        """
        self._log.error("step failed", error=repr(error), step_id=plan.step_id)
        seqs = self._batch.seqs
        failed = {seqs[w.seq_id].request.audit_id for w in plan.seqs if w.seq_id in seqs}
        for load in plan.slot_loads:  # the slot may hold half an adapter: forget it
            self.slots.evict(load.fingerprint)
        for rid in failed:
            if self.fail(rid):
                result.failed.append((rid, RequestFailedError(f"request {rid} failed in the model step: {error!r}")))
