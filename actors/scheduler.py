"""Scheduler actor: the scheduling policy (loraledger/scheduling/) driven over messages, with steps kept in flight.

One step = schedule (the policy) -> execute (Executor's StepThread) -> update (the policy), and the
updates go to the OutputAssembler. This actor owns what needs the event loop: the inbox, the steps in
flight, holding each step's tokens until the next step is on its way, the per-step timings, preemption
events for the audit log, and failing every request it holds when the engine stops.

Overlapped scheduling (`depth` 2, EngineArgs.async_scheduling): step N+1 is planned and sent while
step N runs (SchedulingPolicy.schedule(ahead=True)); when the policy cannot plan ahead without
preempting, the actor waits for the steps in flight and plans that step alone. A sequence under a
grammar (structured outputs) is planned ahead like any other, but its mask needs the token before it:
the runner reads the previous step's ids back before masking such a step (as it does for penalties),
so those steps do not overlap.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from contextlib import nullcontext

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
    SeqUpdate,
    Shutdown,
    StepDone,
    StepTokens,
    StopSeq,
    UnpinSlot,
)
from loraledger.actors.replies import answer
from loraledger.actors.step_stats import StepStats
from loraledger.errors import EngineDeadError
from loraledger.logging import get_logger
from loraledger.scheduling.policy import ScheduledStep, SchedulingPolicy
from loraledger.scheduling.scheduler_config import SchedulerConfig
from loraledger.scheduling.step_update import StepResult
from loraledger.store.records import EventKind, EventRecord


class Scheduler:
    def __init__(
        self,
        inbox: MemoryObjectReceiveStream,
        executor: MemoryObjectSendStream,
        assembler: MemoryObjectSendStream,
        audit: MemoryObjectSendStream | None,
        config: SchedulerConfig,
    ) -> None:
        self._inbox = inbox
        self._executor = executor
        self._assembler = assembler
        self._audit = audit
        self._depth = config.depth
        self.policy = SchedulingPolicy(config)
        self._undelivered: StepTokens | None = None  # the last step's tokens, sent once the next step is on its way
        self._inflight: deque[_Inflight] = deque()  # plans sent, results not back yet, oldest first
        self._flushed = True  # the Executor knows no plan follows the ones in flight
        self._last_done: float | None = None
        self._stats = StepStats()
        self._log = get_logger("scheduler")

    # --- actor loop ---------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        async with self._inbox, self._executor, self._assembler, self._audit or nullcontext():
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
                step = self.policy.schedule(ahead=bool(self._inflight))
                if step is not None:
                    # one step at a time: have it reported as soon as it is done
                    await self._executor.send(ExecuteStep(plan=step.plan, flush=self._depth == 1))
                    self._inflight.append(_Inflight(step, started, time.perf_counter() - started))
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
            rid = getattr(msg, "audit_id", None)
            self._log.exception("message not handled", kind=type(msg).__name__, request_id=rid)
            if isinstance(msg, NewRequest):  # the policy takes a request whole or not at all: nothing to undo here
                error = request_error(exc, msg.caller_request_id or rid, "scheduler", audit_id=rid)
                await self._to_assembler(RequestFailed(audit_id=rid, error=error))
            elif isinstance(msg, (PinSlot, GetStats)):
                await answer(msg.reply, request_error(exc, "-", "scheduler"))
            return True

    async def _handle_one(self, msg) -> bool:
        match msg:
            case NewRequest():
                self.policy.add(msg)
            case Abort(audit_ids=ids):
                await self._abort(ids)
            case StopSeq(audit_id=rid, seq_index=index):
                self.policy.stop(rid, index)
            case PinSlot(fingerprint=fp, checkpoint=ckpt, reply=reply):
                self.policy.pin(fp, ckpt)
                await answer(reply, True)
            case UnpinSlot(fingerprint=fp):
                self.policy.unpin(fp)
            case GetStats(reply=reply):
                await answer(reply, self._stats.snapshot(self.policy.blocks, self.policy.queue_state()))
            case Shutdown():
                return False
            case StepDone():
                await self._step_done(msg)
        return True

    async def _abort(self, audit_ids: list[str]) -> None:
        ended = self.policy.abort(audit_ids)
        if ended:
            updates = [
                SeqUpdate(audit_id=rid, seq_index=index, token_ids=[], logprobs=[], finish_reason="abort")
                for rid, index in ended
            ]
            await self._to_assembler(StepTokens(updates=updates, time=time.time()))

    # --- after a step -------------------------------------------------------------------------

    async def _step_done(self, done: StepDone) -> None:
        if not self._inflight or self._inflight[0].step.plan.step_id != done.step_id:
            self._log.error("a step result out of order was dropped", step_id=done.step_id)
            return
        entry = self._inflight.popleft()
        started = time.perf_counter()
        await self._deliver(self.policy.update(entry.step, done.output, done.error))
        now = time.perf_counter()
        # wall time per step: since the last result, or since this plan was made if the engine was idle
        wall = now - max(entry.started, self._last_done or entry.started)
        self._last_done = now
        self._stats.add(entry.step.plan, done.output, entry.schedule_seconds, now - started, wall)

    async def _deliver(self, result: StepResult) -> None:
        """Preemptions on record, the step's tokens held for the assembler, failed requests ended."""
        if self._audit is not None:
            for rid, index in result.preempted:
                event = EventRecord(
                    kind=EventKind.REQUEST_PREEMPTED, at=result.time, request_id=rid, payload={"seq_index": index}
                )
                await self._audit.send(AuditAppend(events=[event]))
        if result.updates or result.timings:
            # held until the next step is on its way (or there is none): output assembly and
            # detokenization then overlap the next forward pass instead of delaying it
            await self._flush_tokens()
            self._undelivered = StepTokens(updates=result.updates, timings=result.timings, time=result.time)
        for rid, error in result.failed:
            await self._to_assembler(RequestFailed(audit_id=rid, error=error))

    async def _flush_tokens(self) -> None:
        """Hand the held StepTokens to the OutputAssembler; every other message to it goes after them."""
        if self._undelivered is not None:
            held, self._undelivered = self._undelivered, None
            await self._assembler.send(held)

    async def _to_assembler(self, msg: object) -> None:
        await self._flush_tokens()
        await self._assembler.send(msg)

    async def _fail_everything(self, error: Exception) -> None:
        for rid in self.policy.abandon_all():
            try:
                await self._to_assembler(RequestFailed(audit_id=rid, error=error))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return


class _Inflight:
    """A step the Executor has, with when it was planned and how long planning took."""

    __slots__ = ("step", "started", "schedule_seconds")

    def __init__(self, step: ScheduledStep, started: float, schedule_seconds: float) -> None:
        self.step = step
        self.started = started
        self.schedule_seconds = schedule_seconds
