"""The Scheduler actor around the policy: plans out, results in, tokens held until the next step is on its way,
overlap depth, preemptions on record, aborts, a request that cannot be added, and failing everyone at shutdown."""

from __future__ import annotations

import math

import anyio

from loraledger.actors.messages import (
    Abort,
    AuditAppend,
    ExecuteStep,
    FlushSteps,
    GetStats,
    NewRequest,
    RequestFailed,
    Shutdown,
    StepDone,
    StepTokens,
)
from loraledger.actors.scheduler import Scheduler
from loraledger.errors import EngineDeadError, RequestFailedError
from loraledger.sampling_params import SamplingParams
from loraledger.scheduling.scheduler_config import SchedulerConfig
from loraledger.scheduling.step_plan import SampledToken, StepOutput
from loraledger.store.records import EventKind

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def _config(**overrides) -> SchedulerConfig:
    options = dict(
        num_kv_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, max_loras=1
    )
    return SchedulerConfig(**{**options, **overrides})


def _request(rid: str, prompt: list[int], params: SamplingParams = GREEDY, **fields) -> NewRequest:
    return NewRequest(
        audit_id=rid,
        prompt_token_ids=prompt,
        params=params.frozen(),
        lora_request=None,
        checkpoint=None,
        arrival_time=0.0,
        queued_time=0.0,
        **fields,
    )


def _done(plan, token: int = 9) -> StepDone:
    sampled = [SampledToken(seq_id=w.seq_id, token_id=token, logprob=0.0) for w in plan.seqs if w.sample]
    return StepDone(output=StepOutput(step_id=plan.step_id, sampled=sampled), step_id=plan.step_id)


class Harness:
    """The actor with its three outboxes drained into lists."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.send, inbox = anyio.create_memory_object_stream(math.inf)
        to_executor, self.executor = anyio.create_memory_object_stream(math.inf)
        to_assembler, self.assembler = anyio.create_memory_object_stream(math.inf)
        to_audit, self.audit = anyio.create_memory_object_stream(math.inf)
        self.actor = Scheduler(inbox, to_executor, to_assembler, to_audit, config)

    @staticmethod
    def drain(stream) -> list:
        out = []
        while True:
            try:
                out.append(stream.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream):
                return out


async def test_one_step_at_a_time_and_tokens_follow_once_the_next_step_is_sent():
    h = Harness(_config())
    async with anyio.create_task_group() as tg:
        await tg.start(h.actor.run)
        await h.send.send(_request("r", [5, 6, 7]))
        await anyio.wait_all_tasks_blocked()
        [first] = h.drain(h.executor)
        assert isinstance(first, ExecuteStep) and first.flush  # depth 1: report as soon as it is done
        await h.send.send(_done(first.plan))
        await anyio.wait_all_tasks_blocked()
        [second] = h.drain(h.executor)
        [tokens] = h.drain(h.assembler)  # step 1's tokens, sent once step 2 was on its way
        assert isinstance(tokens, StepTokens) and [u.token_ids for u in tokens.updates] == [[9]]
        assert [t.audit_id for t in tokens.timings] == ["r"]
        await h.send.send(_done(second.plan))
        await anyio.wait_all_tasks_blocked()
        [third] = h.drain(h.executor)
        await h.send.send(_done(third.plan))
        await anyio.wait_all_tasks_blocked()
        assert h.drain(h.executor) == []  # max_tokens=3: nothing more to run
        updates = [u for msg in h.drain(h.assembler) for u in msg.updates]
        assert [u.finish_reason for u in updates] == [None, "length"]  # the last step's tokens: flushed when idle
        await h.send.send(Shutdown())


async def test_depth_two_keeps_a_second_step_in_flight_and_flushes_when_nothing_follows():
    h = Harness(_config(depth=2))
    async with anyio.create_task_group() as tg:
        await tg.start(h.actor.run)
        await h.send.send(_request("r", [5, 6, 7]))
        await anyio.wait_all_tasks_blocked()
        sent = h.drain(h.executor)
        assert [type(m) for m in sent] == [ExecuteStep, ExecuteStep, FlushSteps]  # max_tokens=3: no third ahead
        assert not sent[0].flush and sent[1].plan.seqs[0].token_ids == [-1]  # PENDING_TOKEN: step 1's sample
        await h.send.send(Shutdown())


async def test_preemptions_go_on_record_and_aborts_end_sequences_at_once():
    h = Harness(_config(num_kv_blocks=5, max_model_len=32))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    async with anyio.create_task_group() as tg:
        await tg.start(h.actor.run)
        h.send.send_nowait(_request("old", list(range(1, 9)), params))  # both in before the first plan
        h.send.send_nowait(_request("young", list(range(11, 19)), params))
        await anyio.wait_all_tasks_blocked()
        for _ in range(2):  # the second step preempts the young request: on record when that step is done
            [msg] = h.drain(h.executor)
            await h.send.send(_done(msg.plan))
            await anyio.wait_all_tasks_blocked()
        [event] = [e for msg in h.drain(h.audit) if isinstance(msg, AuditAppend) for e in msg.events]
        assert event.kind == EventKind.REQUEST_PREEMPTED and event.request_id == "young"
        await h.send.send(Abort(audit_ids=["old", "young"]))
        await anyio.wait_all_tasks_blocked()
        aborted = [u for msg in h.drain(h.assembler) for u in msg.updates if u.finish_reason == "abort"]
        assert sorted(u.audit_id for u in aborted) == ["old", "young"]
        await h.send.send(Shutdown())


async def test_a_request_that_cannot_be_added_fails_alone_and_shutdown_fails_the_rest():
    h = Harness(_config())  # no vocab_size: logprobs=-1 cannot be served
    async with anyio.create_task_group() as tg:
        await tg.start(h.actor.run)
        h.send.send_nowait(_request("bad", [5, 6], SamplingParams(logprobs=-1), caller_request_id="mine"))
        h.send.send_nowait(_request("waits", [5, 6, 7]))
        await anyio.wait_all_tasks_blocked()
        [failed] = [m for m in h.drain(h.assembler) if isinstance(m, RequestFailed)]
        assert failed.audit_id == "bad" and isinstance(failed.error, RequestFailedError)
        reply_send, reply = anyio.create_memory_object_stream(1)
        await h.send.send(GetStats(reply=reply_send))
        stats = await reply.receive()
        assert stats.num_requests_running == 1 and stats.max_loras == 1
        await h.send.send(Shutdown())
    [stopped] = [m for m in h.drain(h.assembler) if isinstance(m, RequestFailed)]
    assert stopped.audit_id == "waits" and isinstance(stopped.error, EngineDeadError)
