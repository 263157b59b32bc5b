"""Scheduler actor: continuous batching over the paged KV cache, adapter-slot assignment, preemption, stop checks.

One step = schedule (this actor) -> execute (Executor's StepThread) -> update (this actor),
and the updates go to the OutputAssembler. Requests join and leave the running batch at step
boundaries; prefills (chunked to the token budget) and decodes share a step; when KV blocks run
out the youngest running sequence is preempted and later recomputed (its output is unchanged: the
sampler's randomness is keyed by (seed, position), not by batch). At most max_loras distinct
adapters run in a step; a request whose adapter cannot get a slot waits, and once it has waited
at the head of the queue for `max_head_skips` steps nothing else is admitted ahead of it.

Overlapped scheduling (`depth` 2, EngineArgs.async_scheduling): step N+1 is planned and sent while
step N runs, each sequence that step N samples taking PENDING_TOKEN as its input (the runner fills
it in on the device). What step N's tokens decide is settled when they come back: a sequence that
stops there (EOS, a stop id or string) had one step's work too many, which is dropped. A plan made
ahead never preempts: when KV blocks run short, the Scheduler waits for the steps in flight and
plans that step alone. A sequence under a grammar (structured outputs) is planned ahead like any
other, but its mask needs the token before it: the runner reads the previous step's ids back before
masking such a step (as it does for penalties), so those steps do not overlap; a grammar that
completes ends its sequence with finish_reason "stop" (SampledToken.grammar_done).

Seats in the running batch are shared fairly between requests: waiting sequences are admitted
round-robin by request, a request holds at most an equal share of max_num_seqs while others want
seats, and when every seat is taken, a request above its share gives one up (its youngest sequence
is preempted) to a waiting request that has none, so a request with a large n does not hold back
the requests that arrive after it.
"""

from __future__ import annotations

import bisect
import contextlib
import random
import time
from collections import Counter, deque

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from loraledger.actors.failures import request_error
from loraledger.actors.messages import (
    Abort,
    AuditAppend,
    ExecuteStep,
    FlushSteps,
    GetStats,
    NewRequest,
    PinSlot,
    RequestFailed,
    RequestTiming,
    SeqUpdate,
    Shutdown,
    StepDone,
    StepTokens,
    StopSeq,
    UnpinSlot,
)
from loraledger.actors.replies import answer
from loraledger.actors.scheduler_state import SchedRequest, Seq, SeqStatus
from loraledger.actors.step_stats import StepStats
from loraledger.errors import EngineDeadError, RequestFailedError, StructuredOutputError
from loraledger.logging import get_logger, request_logger
from loraledger.scheduling.block_manager import BlockManager
from loraledger.scheduling.step_plan import PENDING_TOKEN, NewSeq, SamplingSpec, SeqWork, SlotLoad, StepPlan
from loraledger.store.records import EventKind, EventRecord


class Scheduler:
    def __init__(
        self,
        inbox: MemoryObjectReceiveStream,
        executor: MemoryObjectSendStream,
        assembler: MemoryObjectSendStream,
        audit: MemoryObjectSendStream | None,
        *,
        num_kv_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_loras: int,
        eos_token_ids: tuple[int, ...],
        seed: int | None,
        max_head_skips: int = 8,
        depth: int = 1,
        extra_stop_ids: tuple[int, ...] = (),
        vocab_size: int | None = None,
        chunked_prefill: bool = True,
    ) -> None:
        """depth: steps in flight at once; 1 waits for each step's tokens, 2 plans each step while the one before it runs.

        extra_stop_ids: the generation config's EOS ids beyond eos_token_ids; as in vLLM they join each request's
        stop_token_ids (unless ignore_eos), so they end it with that id as its stop_reason. vocab_size: what
        logprobs=-1 asks for. chunked_prefill False: a prompt is scheduled whole in one step, never in chunks."""
        self._inbox = inbox
        self._executor = executor
        self._assembler = assembler
        self._audit = audit
        self._blocks = BlockManager(num_kv_blocks, block_size, enable_prefix_caching)
        self._block_size = block_size
        self._max_num_seqs = max_num_seqs
        self._budget = max_num_batched_tokens
        self._max_model_len = max_model_len
        self._eos = frozenset(eos_token_ids)
        self._extra_stop = frozenset(extra_stop_ids) - self._eos
        self._vocab_size = vocab_size
        self._chunked = chunked_prefill
        self._rng = random.Random(seed)
        self._max_head_skips = max_head_skips

        self._requests: dict[str, SchedRequest] = {}
        self._seqs: dict[int, Seq] = {}
        self._waiting: deque[Seq] = deque()
        self._running: list[Seq] = []  # sorted by Seq.key: oldest first, so the youngest is last
        self._next_seq_id = 0
        self._next_order = 0
        self._step_id = 0
        self._freed: list[int] = []
        self._undelivered: StepTokens | None = None  # the last step's tokens, sent once the next step is on its way
        self._depth = depth
        self._inflight: deque[_Inflight] = deque()  # plans sent, results not back yet, oldest first
        self._flushed = True  # the Executor knows no plan follows the ones in flight
        self._last_done: float | None = None

        # adapter slots: slot -> fingerprint (or None), fingerprint -> slot, last step a slot was used
        self._slot_fp: list[str | None] = [None] * max_loras
        self._fp_slot: dict[str, int] = {}
        self._slot_used_step: list[int] = [-1] * max_loras
        self._slot_names: dict[str, str] = {}  # fingerprint -> adapter name, for the slot counters
        self._pinned: dict[str, object] = {}  # fingerprint -> checkpoint
        self._draining: str | None = None  # adapter taking no new requests so a starved head gets its slot
        self._yielded_from: set[SchedRequest] = set()  # requests that gave a seat up in this step (fair share)
        self._stats = StepStats()
        self._log = get_logger("scheduler")

    # --- actor loop ---------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        async with self._inbox, self._executor, self._assembler:
            task_status.started()
            try:
                await self._loop()
            finally:
                with anyio.move_on_after(5, shield=True):
                    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                        await self._flush_tokens()  # the assembler may have stopped first
                    await self._fail_everything(EngineDeadError("the engine stopped before this request finished"))

    async def _loop(self) -> None:
        while True:
            while True:  # take in whatever arrived (step results, requests) before scheduling
                try:
                    msg = self._inbox.receive_nowait()
                except anyio.WouldBlock:
                    break
                except anyio.EndOfStream:
                    return
                if not await self._handle(msg):
                    return
            if len(self._inflight) < self._depth:
                started = time.perf_counter()
                plan, preempted = self._schedule(ahead=bool(self._inflight))
                if plan is not None:
                    # one step at a time: have it reported as soon as it is done
                    await self._executor.send(ExecuteStep(plan=plan, flush=self._depth == 1))
                    self._inflight.append(_Inflight(plan, preempted, started, time.perf_counter() - started))
                    self._flushed = self._depth == 1
                    await self._flush_tokens()  # the last step's tokens: assembled while this step runs
                    continue
            if self._inflight and not self._flushed:
                await self._executor.send(FlushSteps())  # nothing to overlap with: report what runs
                self._flushed = True
            if not self._inflight:
                await self._flush_tokens()
            try:
                msg = await self._inbox.receive()
            except anyio.EndOfStream:
                return
            if not await self._handle(msg):
                return

    async def _handle(self, msg) -> bool:
        """Act on one message; False on Shutdown. A message that cannot be handled fails its request only."""
        try:
            return await self._handle_one(msg)
        except Exception as exc:  # the failure boundary: this message's request fails, the scheduler goes on
            rid = getattr(msg, "request_id", None)
            self._log.exception("message not handled", kind=type(msg).__name__, request_id=rid)
            if isinstance(msg, NewRequest):  # _add enters a request whole or not at all: nothing to undo here
                error = request_error(exc, msg.caller_request_id or rid, "scheduler", audit_id=rid)
                await self._to_assembler(RequestFailed(request_id=rid, error=error))
            elif isinstance(msg, (PinSlot, GetStats)):
                await answer(msg.reply, request_error(exc, "-", "scheduler"))
            return True

    async def _handle_one(self, msg) -> bool:
        match msg:
            case NewRequest():
                self._add(msg)
            case Abort(request_ids=ids):
                await self._abort(ids)
            case StopSeq(request_id=rid, seq_index=index):
                await self._stop_from_string(rid, index)
            case PinSlot(fingerprint=fp, checkpoint=ckpt, reply=reply):
                self._pinned[fp] = ckpt
                await answer(reply, True)
            case UnpinSlot(fingerprint=fp):
                self._pinned.pop(fp, None)
            case GetStats(reply=reply):
                await answer(reply, self._stats.snapshot(self._blocks, self._queues()))
            case Shutdown():
                return False
            case StepDone():
                await self._step_done(msg)
        return True

    async def _step_done(self, done: StepDone) -> None:
        if not self._inflight or self._inflight[0].plan.step_id != done.step_id:
            self._log.error("a step result out of order was dropped", step_id=done.step_id)
            return
        entry = self._inflight.popleft()
        started = time.perf_counter()
        await self._on_step_done(entry, done)
        now = time.perf_counter()
        # wall time per step: since the last result, or since this plan was made if the engine was idle
        wall = now - max(entry.started, self._last_done or entry.started)
        self._last_done = now
        self._stats.add(entry.plan, done.output, entry.schedule_seconds, now - started, wall)

    # --- requests -----------------------------------------------------------------------------

    def _add(self, msg: NewRequest) -> None:
        params = msg.params
        ckpt = msg.checkpoint
        prompt_len = len(msg.prompt_token_ids)
        room = self._max_model_len - prompt_len
        max_output = min(params.max_tokens, room) if params.max_tokens is not None else room
        eos = frozenset() if params.ignore_eos else self._eos
        stop_ids = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self._extra_stop)
        req = SchedRequest(
            request_id=msg.request_id,
            order=self._next_order,
            params=params,
            lora_request=msg.lora_request,
            checkpoint=ckpt,
            salt=ckpt.fingerprint if ckpt is not None else "",
            prompt_len=prompt_len,
            max_output=max(1, max_output),
            stop_ids=stop_ids,
            eos_ids=eos,
            grammar=msg.grammar,
            caller_request_id=msg.caller_request_id,
        )
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        bias = params.logit_bias or {}
        for index in range(params.n):
            spec = SamplingSpec(
                temperature=float(params.temperature),
                top_p=float(params.top_p),
                top_k=int(params.top_k),
                min_p=float(params.min_p),
                # vLLM's parallel sampling: completion i of a seeded request draws as a request with seed + i would
                seed=_mix_seed(base_seed + index, 0),
                presence_penalty=float(params.presence_penalty),
                frequency_penalty=float(params.frequency_penalty),
                repetition_penalty=float(params.repetition_penalty),
                logprobs=self._num_logprobs(params.logprobs),
                prompt_logprobs=-1 if index > 0 else self._num_logprobs(params.prompt_logprobs),
                min_tokens=int(params.min_tokens),
                stop_ids=sorted(eos | stop_ids),
                bias_token_ids=list(bias),
                bias_values=list(bias.values()),
                allowed_token_ids=list(params.allowed_token_ids or ()),
                bad_words=[list(w) for w in msg.bad_words_token_ids],
            )
            req.seqs.append(
                Seq(
                    seq_id=self._next_seq_id + index,
                    index=index,
                    request=req,
                    token_ids=list(msg.prompt_token_ids),
                    spec=spec,
                )
            )
        # every sequence was built: only now does the request enter the scheduler's state (nothing half-added)
        self._next_order += 1
        self._next_seq_id += len(req.seqs)
        for seq in req.seqs:
            self._seqs[seq.seq_id] = seq
            self._waiting.append(seq)
        self._requests[req.request_id] = req

    def _queues(self) -> dict:
        """The queue state GetStats reports (a request is running while any of its sequences is)."""
        running = {s.request for s in self._running}
        waiting = [r for r in self._requests.values() if r not in running]

        def names(reqs) -> list[str]:
            return sorted({r.lora_request.lora_name for r in reqs if r.lora_request is not None})

        return {
            "num_requests_running": len(running),
            "num_requests_waiting": len(waiting),
            "running_lora_adapters": names(running),
            "waiting_lora_adapters": names(waiting),
            "max_loras": len(self._slot_fp),
        }

    def _num_logprobs(self, asked: int | None) -> int:
        """SamplingSpec's count: -1 for none; SamplingParams' -1 (the whole vocabulary) as the vocabulary's size."""
        if asked is None:
            return -1
        if asked == -1:
            if self._vocab_size is None:
                raise RequestFailedError(
                    "logprobs=-1 asks for the whole vocabulary, whose size this scheduler was not given"
                )
            return self._vocab_size
        return int(asked)

    def _finish_seq(self, seq: Seq) -> None:
        seq.status = SeqStatus.FINISHED
        self._blocks.free(seq.seq_id)
        self._seqs.pop(seq.seq_id, None)
        if seq.announced:
            self._freed.append(seq.seq_id)
        req = seq.request
        if all(s.status is SeqStatus.FINISHED for s in req.seqs):
            self._requests.pop(req.request_id, None)

    def _remove_from_queues(self, seq: Seq) -> None:
        if seq.status is SeqStatus.RUNNING:
            self._running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            try:
                self._waiting.remove(seq)
            except ValueError:
                pass

    async def _abort(self, request_ids: list[str]) -> None:
        updates = []
        for rid in request_ids:
            req = self._requests.get(rid)
            if req is None:
                continue
            for seq in req.seqs:
                if seq.status is SeqStatus.FINISHED:
                    continue
                self._remove_from_queues(seq)
                self._finish_seq(seq)
                updates.append(
                    SeqUpdate(request_id=rid, seq_index=seq.index, token_ids=[], logprobs=[], finish_reason="abort")
                )
        if updates:
            await self._to_assembler(StepTokens(updates=updates, time=time.time()))

    async def _stop_from_string(self, request_id: str, index: int) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            if seq.index == index and seq.status is not SeqStatus.FINISHED:
                self._remove_from_queues(seq)
                self._finish_seq(seq)

    async def _fail_everything(self, error: Exception) -> None:
        for rid in list(self._requests):
            try:
                await self._to_assembler(RequestFailed(request_id=rid, error=error))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return
        self._requests.clear()

    # --- scheduling ---------------------------------------------------------------------------

    def _schedule(self, ahead: bool = False) -> tuple[StepPlan | None, list[Seq]]:
        """The next plan (or None) and the sequences preempted for it.

        ahead: steps are in flight, whose sampled tokens are not known yet (they become PENDING_TOKEN
        inputs). Such a plan never preempts (for KV blocks or for a fair seat): the sequences it would
        recompute are still being computed; it returns None, and the step is planned once they are back.
        """
        budget = self._budget
        work: list[tuple[Seq, int]] = []
        active_fps: set[str] = set()
        preempted: list[Seq] = []
        if ahead:
            if self._seat_victims():
                return None, []  # a fair seat needs a preemption: plan it once the steps in flight are back
            self._yielded_from.clear()
            yielded: list[Seq] = []
        else:
            yielded = self._make_room_for_waiting()  # fair share: seats for requests that have none

        running = list(self._running)
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
            if ahead and not self._blocks.can_allocate(seq.seq_id, seq.num_scheduled + num_new):
                return None, []  # short of KV blocks: plan once the steps in flight are back, preempting then
            while not self._blocks.can_allocate(seq.seq_id, seq.num_scheduled + num_new):
                victim = self._running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            self._blocks.allocate(seq.seq_id, seq.num_scheduled + num_new)
            work.append((seq, num_new))
            if seq.request.salt:
                active_fps.add(seq.request.salt)
            budget -= num_new
            i += 1
            if budget <= 0:
                break

        if not preempted:
            self._admit_waiting(work, active_fps, budget)

        if not work:
            return None, yielded + preempted
        return self._build_plan(work), yielded + preempted

    def _ends_in_flight(self, seq: Seq) -> bool:
        """The steps in flight will end this sequence by length whatever they sample: plan nothing more for it."""
        if not seq.pending:
            return False
        return (
            seq.num_output + seq.pending >= seq.request.max_output
            or len(seq.token_ids) + seq.pending >= self._max_model_len
        )

    def _admit_waiting(self, work: list[tuple[Seq, int]], active_fps: set[str], budget: int) -> None:
        """Move waiting sequences into the running set while seats, tokens and KV blocks last.

        Fair across requests: waiting sequences are taken round-robin by request (every request's
        first waiting sequence, in arrival order, then every request's second, ...), first for
        requests that hold no seat, then for those below their share of the seats (max_num_seqs /
        unfinished requests), then for anyone. A request with a large n therefore cannot hold back
        the requests that arrive after it.
        """
        if not self._waiting or budget <= 0 or len(self._running) >= self._max_num_seqs:
            return
        seats = Counter(s.request for s in self._running)
        share = self._fair_share()
        admitted: list[Seq] = []
        head_blocked = False  # the first sequence considered waits for an adapter slot
        head_seen = False
        draining: str | None = None
        stop = False
        order = list(self._round_robin())
        for cap in (1, share, None):  # seatless requests first, then those below their share, then anyone
            for seq in order:
                if stop or budget <= 0 or len(self._running) >= self._max_num_seqs:
                    break
                req = seq.request
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
                if req.salt and not self._slot_available(req.salt, active_fps):
                    if is_head and not head_blocked:
                        head_blocked = True
                        req.blocked_steps += 1
                        if req.blocked_steps > self._max_head_skips:
                            # the head has waited long enough: one running adapter takes no new requests,
                            # so its slot frees within one request's length and the head gets it next;
                            # the other slots keep the batch full meanwhile
                            draining = self._drain_target()
                            if draining is None:
                                stop = True
                                break
                    continue
                if draining is not None and req.salt == draining:
                    continue
                use_cache = seq.spec.prompt_logprobs < 0 or req.prompt_logprobs_done
                prefix_blocks, cached = self._blocks.lookup_prefix(seq.token_ids, req.salt) if use_cache else ([], 0)
                num_new = min(len(seq.token_ids) - cached, budget)
                if not self._chunked and num_new < len(seq.token_ids) - cached:
                    stop = True  # enable_chunked_prefill=False: the prompt waits for a step with room for all of it
                    break
                if not self._blocks.can_allocate(seq.seq_id, cached + num_new, prefix_blocks):
                    stop = True  # out of KV blocks: admitting later (smaller) requests first would starve this one
                    break
                self._blocks.allocate(seq.seq_id, cached + num_new, prefix_blocks)
                seq.num_computed = seq.num_scheduled = cached
                seq.status = SeqStatus.RUNNING
                bisect.insort(self._running, seq, key=lambda s: s.key)
                if req.num_cached_tokens is None:
                    req.num_cached_tokens = cached
                if req.salt:
                    active_fps.add(req.salt)
                work.append((seq, num_new))
                budget -= num_new
                seats[req] += 1
                admitted.append(seq)
        if admitted:
            self._leave_waiting(admitted)

    def _round_robin(self):
        """The waiting sequences, one per request at a time: round k holds each request's k-th waiting
        sequence, requests in the order they first appear in the queue (oldest, or preempted, first)."""
        later: list[tuple[int, int, Seq]] = []
        seen: Counter = Counter()
        for position, seq in enumerate(list(self._waiting)):
            k = seen[seq.request]
            seen[seq.request] = k + 1
            if k == 0:
                yield seq
            else:
                later.append((k, position, seq))
        later.sort(key=lambda item: item[:2])
        for _, _, seq in later:
            yield seq

    def _leave_waiting(self, admitted: list[Seq]) -> None:
        """Take the admitted sequences out of the waiting queue, the others keeping their order."""
        n = len(admitted)
        if n <= len(self._waiting) and all(self._waiting[i] is seq for i, seq in enumerate(admitted)):
            for _ in range(n):  # the common case: the head of the queue, in order
                self._waiting.popleft()
            return
        gone = {id(seq) for seq in admitted}
        rest = [seq for seq in self._waiting if id(seq) not in gone]
        self._waiting.clear()
        self._waiting.extend(rest)

    def _fair_share(self) -> int:
        """Seats a request may hold while others want them: an equal part of max_num_seqs per unfinished request."""
        return max(1, self._max_num_seqs // max(1, len(self._requests)))

    def _seat_victims(self) -> list[Seq]:
        """With every seat taken, the sequences of requests above their fair share to preempt so that waiting
        requests with no seat at all get one in this step: each time the youngest sequence of the request
        holding the most seats (the youngest request among equals)."""
        if len(self._running) < self._max_num_seqs or not self._waiting:
            return []
        seats = Counter(s.request for s in self._running)
        share = self._fair_share()
        excess = sum(count - share for count in seats.values() if count > share)
        if excess <= 0:
            return []  # nobody holds more than a share (the usual case: one sequence per request)
        seatless: list = []
        for seq in self._waiting:
            req = seq.request
            if seats[req] or req in seatless:
                continue
            if req.salt and not self._slot_available(req.salt, set()):
                continue  # it could not run now anyway: no seat is taken from anyone for it
            seatless.append(req)
            if len(seatless) >= excess:
                break
        victims: list[Seq] = []
        for _ in seatless:
            richest = max(seats, key=lambda r: (seats[r], r.order))
            if seats[richest] <= share:
                break
            victims.append(
                max((s for s in self._running if s.request is richest and s not in victims), key=lambda s: s.index)
            )
            seats[richest] -= 1
        return victims

    def _make_room_for_waiting(self) -> list[Seq]:
        """Preempt _seat_victims() (they go back to the queue, recomputed later with an unchanged output);
        returns them."""
        self._yielded_from.clear()  # one step's worth
        victims = self._seat_victims()
        for victim in victims:
            self._preempt(victim)
            self._yielded_from.add(victim.request)
        return victims

    def _drain_target(self) -> str | None:
        """The running adapter to stop feeding so a slot frees: the one closest to done, kept until it is."""
        remaining: dict[str, int] = {}
        for s in self._running:
            fp = s.request.salt
            if fp and fp not in self._pinned:
                remaining[fp] = max(remaining.get(fp, 0), s.request.max_output - s.num_output)
        if self._draining not in remaining:
            self._draining = min(remaining, key=remaining.__getitem__) if remaining else None
        return self._draining

    def _slot_available(self, fp: str, active_fps: set[str]) -> bool:
        """Can fp run in this step? Slots are free to reassign except those of running or pinned adapters."""
        if fp in active_fps:
            return True
        needed = {s.request.salt for s in self._running} | active_fps | set(self._pinned) | {fp}
        needed.discard("")
        return len(needed) <= len(self._slot_fp)

    def _preempt(self, seq: Seq) -> None:
        self._running.remove(seq)
        self._blocks.free(seq.seq_id)
        seq.num_computed = seq.num_scheduled = seq.pending = 0  # no step is in flight when one preempts
        seq.status = SeqStatus.WAITING
        self._waiting.appendleft(seq)
        log = request_logger(
            self._log, seq.request.request_id, seq.request.lora_request and seq.request.lora_request.lora_name
        )
        log.info("preempted for recompute", seq_index=seq.index, tokens=len(seq.token_ids))

    def _assign_slots(self, fps: set[str]) -> list[SlotLoad]:
        loads = []
        for fp in sorted(fps):  # sorted: a deterministic slot layout for the same batch
            if fp in self._fp_slot:
                self._slot_used_step[self._fp_slot[fp]] = self._step_id
                continue
            free = [i for i, f in enumerate(self._slot_fp) if f is None]
            if free:
                slot = free[0]
            else:
                # never take the slot of an adapter whose sequences are running, even if not in this step
                in_use = fps | {s.request.salt for s in self._running}
                candidates = [i for i, f in enumerate(self._slot_fp) if f not in in_use and f not in self._pinned]
                slot = min(candidates, key=lambda i: self._slot_used_step[i])
                evicted = self._slot_fp[slot]
                del self._fp_slot[evicted]
                self._stats.slot_evictions[self._slot_names.get(evicted, evicted[:12])] += 1
            ckpt = self._checkpoint_for(fp)
            self._slot_names[fp] = getattr(ckpt, "name", None) or fp[:12]
            self._stats.slot_loads[self._slot_names[fp]] += 1
            self._slot_fp[slot] = fp
            self._fp_slot[fp] = slot
            self._slot_used_step[slot] = self._step_id
            loads.append(SlotLoad(slot=slot, fingerprint=fp, checkpoint=ckpt))
        return loads

    def _checkpoint_for(self, fp: str):
        if fp in self._pinned:
            return self._pinned[fp]
        for req in self._requests.values():
            if req.salt == fp:
                return req.checkpoint
        raise RuntimeError(f"no checkpoint for adapter {fp[:12]}")

    def _build_plan(self, work: list[tuple[Seq, int]]) -> StepPlan:
        fps = {seq.request.salt for seq, _ in work if seq.request.salt}
        loads = self._assign_slots(fps)
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
            seq_work.append(
                SeqWork(
                    seq_id=seq.seq_id,
                    token_ids=token_ids,
                    start_pos=start,
                    block_table=self._blocks.block_table(seq.seq_id),
                    lora_slot=self._fp_slot[req.salt] if req.salt else -1,
                    sample=sample,
                    prompt_logprobs=seq.spec.prompt_logprobs >= 0
                    and not req.prompt_logprobs_done
                    and start < req.prompt_len,
                )
            )
            seq.num_scheduled = end
            if sample:
                seq.pending += 1
        self._step_id += 1
        freed, self._freed = self._freed, []
        return StepPlan(step_id=self._step_id, seqs=seq_work, new_seqs=new_seqs, freed_seq_ids=freed, slot_loads=loads)

    # --- after a step -------------------------------------------------------------------------

    async def _on_step_done(self, entry: _Inflight, done: StepDone) -> None:
        plan = entry.plan
        now = time.time()
        timings: dict[str, RequestTiming] = {}
        for seq in entry.preempted:
            rid = seq.request.request_id
            timings[rid] = RequestTiming(request_id=rid, preempted=True)
            if self._audit is not None:
                await self._audit.send(
                    AuditAppend(
                        events=[
                            EventRecord(
                                kind=EventKind.REQUEST_PREEMPTED,
                                at=now,
                                request_id=rid,
                                payload={"seq_index": seq.index},
                            )
                        ]
                    )
                )
        if done.error is not None or done.output is None:
            await self._fail_step(plan, done.error)
            return
        sampled = {s.seq_id: s for s in done.output.sampled}
        prompt_lps = {p.seq_id: p for p in done.output.prompt_logprobs}
        updates: list[SeqUpdate] = []
        refused: set[str] = set()  # requests whose grammar refused a token: each fails, alone
        for work in plan.seqs:
            seq = self._seqs.get(work.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue  # aborted or stopped while the step ran (a step planned ahead: ended by the one before)
            req = seq.request
            rid = req.request_id
            if work.sample:
                seq.pending -= 1
            seq.num_computed = work.start_pos + len(work.token_ids)
            self._blocks.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed, req.salt)
            lp = prompt_lps.get(seq.seq_id)
            if not req.timing_sent or lp is not None:
                req.timing_sent = True
                timings[rid] = RequestTiming(
                    request_id=rid,
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
            finish, stop_reason = self._check_stop(seq, token.token_id, token.grammar_done)
            updates.append(
                SeqUpdate(
                    request_id=rid,
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
                self._running.remove(seq)
                self._finish_seq(seq)
        if refused:
            updates = [u for u in updates if u.request_id not in refused]
        if updates or timings:
            # held until the next step is on its way (or there is none): output assembly and
            # detokenization then overlap the next forward pass instead of delaying it
            await self._flush_tokens()
            self._undelivered = StepTokens(updates=updates, timings=list(timings.values()), time=now)
        for rid in refused:
            req = self._requests.get(rid)
            if req is None:
                continue
            shown = repr(req.caller_request_id or rid) + (
                "" if req.caller_request_id in (None, rid) else f" (audit id {rid})"
            )
            await self._fail_request(rid, StructuredOutputError(
                f"request {shown}: its structured_outputs allow none of the tokens its other sampling parameters leave "
                "(allowed_token_ids, bad_words) at this point of the output; loosen one of them"
            ))  # fmt: skip

    async def _flush_tokens(self) -> None:
        """Hand the held StepTokens to the OutputAssembler; every other message to it goes after them."""
        if self._undelivered is not None:
            held, self._undelivered = self._undelivered, None
            await self._assembler.send(held)

    async def _to_assembler(self, msg: object) -> None:
        await self._flush_tokens()
        await self._assembler.send(msg)

    def _check_stop(self, seq: Seq, token: int, grammar_done: bool = False) -> tuple[str | None, int | None]:
        req = seq.request
        n_out = seq.num_output
        if (
            grammar_done
        ):  # the grammar is complete (it took EOS): nothing more may follow, whatever min_tokens or ignore_eos say
            return "stop", token if token in req.stop_ids else None
        if n_out >= req.params.min_tokens:
            if token in req.stop_ids:
                return "stop", token
            if token in req.eos_ids:
                return "stop", None
        if n_out >= req.max_output or len(seq.token_ids) >= self._max_model_len:
            return "length", None
        return None, None

    async def _fail_step(self, plan: StepPlan, error: object) -> None:
        """A step raised: its requests fail (on record), the engine and every other request go on.

        A step planned ahead of this one may hold the same sequences: finished here, their results there are dropped.
        """
        self._log.error("step failed", error=repr(error), step_id=plan.step_id)
        failed = {self._seqs[w.seq_id].request.request_id for w in plan.seqs if w.seq_id in self._seqs}
        for load in plan.slot_loads:  # the slot may hold half an adapter: forget it
            self._slot_fp[load.slot] = None
            self._fp_slot.pop(load.fingerprint, None)
        for rid in failed:
            await self._fail_request(rid, RequestFailedError(f"request {rid} failed in the model step: {error!r}"))

    async def _fail_request(self, rid: str, error: Exception) -> None:
        """End every sequence of a request and fail it (on record); the engine and every other request go on."""
        req = self._requests.get(rid)
        if req is None:
            return
        for seq in req.seqs:
            if seq.status is not SeqStatus.FINISHED:
                self._remove_from_queues(seq)
                self._finish_seq(seq)
        self._requests.pop(rid, None)
        await self._to_assembler(RequestFailed(request_id=rid, error=error))


class _Inflight:
    """A plan the Executor has, with what the Scheduler needs when its results come back."""

    __slots__ = ("plan", "preempted", "started", "schedule_seconds")

    def __init__(self, plan: StepPlan, preempted: list[Seq], started: float, schedule_seconds: float) -> None:
        self.plan = plan
        self.preempted = preempted  # sequences preempted to make room for this plan (recorded when it is done)
        self.started = started
        self.schedule_seconds = schedule_seconds


def _mix_seed(seed: int, index: int) -> int:
    """A distinct, reproducible 62-bit seed per (seed, index) (splitmix64 finaliser); seeds outside 64 bits wrap."""
    z = ((seed & 0xFFFFFFFFFFFFFFFF) * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 2
