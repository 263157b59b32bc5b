"""The Scheduler shares the running batch between requests: a request with a large n does not hold back later ones.

The real Scheduler actor runs over its message protocol with a stand-in executor that samples a token
for every sequence that asks for one, one step at a time, and requests arrive at given step numbers.
Everything is counted in steps, so the assertions do not depend on timing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import anyio
import pytest

from loraledger.actors.messages import GetStats, NewRequest, Shutdown, StepDone, StepTokens
from loraledger.actors.scheduler import Scheduler
from loraledger.sampling_params import SamplingParams
from loraledger.scheduling.step_plan import SampledToken, StepOutput


@dataclass
class Arrival:
    step: int  # delivered before this step is scheduled
    request_id: str
    n: int
    max_tokens: int
    prompt_len: int = 6


@dataclass
class Run:
    steps: int = 0
    first_token: dict[str, int] = field(default_factory=dict)  # request id -> step of its first token (any sequence)
    finished: dict[str, int] = field(default_factory=dict)  # request id -> step its last sequence finished
    tokens: dict[tuple[str, int], int] = field(default_factory=dict)  # (request id, seq index) -> tokens generated
    preempted: dict[str, int] = field(default_factory=dict)  # request id -> preemptions reported
    max_running: int = 0


def run(arrivals: list[Arrival], *, max_num_seqs: int, max_steps: int = 2000, num_kv_blocks: int = 4096) -> Run:
    return anyio.run(_run, arrivals, max_num_seqs, max_steps, num_kv_blocks)


async def _run(arrivals: list[Arrival], max_num_seqs: int, max_steps: int, num_kv_blocks: int) -> Run:
    inbox_send, inbox = anyio.create_memory_object_stream(math.inf)
    to_executor, executor_inbox = anyio.create_memory_object_stream(math.inf)
    to_assembler, assembler_inbox = anyio.create_memory_object_stream(math.inf)
    scheduler = Scheduler(
        inbox,
        to_executor,
        to_assembler,
        None,
        num_kv_blocks=num_kv_blocks,
        block_size=4,
        enable_prefix_caching=True,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        max_model_len=512,
        max_loras=1,
        eos_token_ids=(),
        seed=0,
    )
    result = Run()
    step = [0]

    async def consume() -> None:
        async for msg in assembler_inbox:
            if isinstance(msg, StepTokens):
                for timing in msg.timings:
                    if timing.preempted:
                        result.preempted[timing.request_id] = result.preempted.get(timing.request_id, 0) + 1
                for u in msg.updates:
                    if u.token_ids:
                        result.first_token.setdefault(u.request_id, step[0])
                        key = (u.request_id, u.seq_index)
                        result.tokens[key] = result.tokens.get(key, 0) + len(u.token_ids)
                    if u.finish_reason is not None:
                        result.finished[u.request_id] = step[0]

    async def settle() -> None:
        # two stats round trips: the Scheduler has acted on everything sent and is waiting again
        for _ in range(2):
            reply_send, reply = anyio.create_memory_object_stream(1)
            await inbox_send.send(GetStats(reply=reply_send))
            async with reply:
                await reply.receive()

    pending = sorted(arrivals, key=lambda a: a.step)
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)
        tg.start_soon(consume)
        while step[0] < max_steps:
            while pending and pending[0].step <= step[0]:
                a = pending.pop(0)
                params = SamplingParams(
                    n=a.n, max_tokens=a.max_tokens, ignore_eos=True, temperature=1.0, seed=0
                )  # greedy allows n=1 only
                await inbox_send.send(
                    NewRequest(
                        request_id=a.request_id,
                        prompt_token_ids=[7] * a.prompt_len,
                        params=params,
                        lora_request=None,
                        checkpoint=None,
                        arrival_time=0.0,
                        queued_time=0.0,
                    )
                )
            await settle()
            try:
                plan = executor_inbox.receive_nowait().plan
            except anyio.WouldBlock:
                if not pending:
                    break
                step[0] = pending[0].step  # idle until the next arrival
                continue
            step[0] += 1
            result.max_running = max(result.max_running, len(plan.seqs))
            sampled = [SampledToken(seq_id=w.seq_id, token_id=9, logprob=0.0) for w in plan.seqs if w.sample]
            await inbox_send.send(
                StepDone(output=StepOutput(step_id=plan.step_id, sampled=sampled), step_id=plan.step_id)
            )
        await inbox_send.send(Shutdown())
    for stream in (inbox_send, executor_inbox, assembler_inbox):
        stream.close()
    result.steps = step[0]
    return result


def test_a_request_at_the_n_limit_does_not_hold_back_a_later_small_one():
    # n = max_num_seqs: the large request fills every seat, then a small request arrives
    big = Arrival(step=0, request_id="big", n=8, max_tokens=60)
    small = Arrival(step=5, request_id="small", n=1, max_tokens=3)
    r = run([big, small], max_num_seqs=8)
    assert r.first_token["big"] <= 2
    # the small request gets a seat at once (one of big's sequences yields it), not after big's 60 steps
    assert r.first_token["small"] - small.step <= 2, r.first_token
    assert r.finished["small"] - small.step <= 5
    assert r.preempted.get("big", 0) >= 1 and "small" not in r.preempted
    # the large request still gets every token of every sequence
    assert all(r.tokens[("big", i)] == 60 for i in range(8))
    assert r.max_running <= 8


def test_later_requests_are_not_queued_behind_a_large_n_that_is_still_waiting():
    # n is twice the batch: half of the large request's sequences are still waiting when the others arrive
    arrivals = [Arrival(step=0, request_id="big", n=16, max_tokens=40)]
    arrivals += [Arrival(step=3, request_id=f"small-{i}", n=1, max_tokens=4) for i in range(3)]
    r = run(arrivals, max_num_seqs=8)
    for i in range(3):
        assert r.first_token[f"small-{i}"] - 3 <= 2, r.first_token
        assert r.finished[f"small-{i}"] - 3 <= 6
    assert all(r.tokens[("big", i)] == 40 for i in range(16))


def test_two_large_requests_share_the_batch_and_a_third_gets_in():
    arrivals = [
        Arrival(step=0, request_id="a", n=8, max_tokens=50),
        Arrival(step=1, request_id="b", n=8, max_tokens=50),
        Arrival(step=4, request_id="c", n=1, max_tokens=2),
    ]
    r = run(arrivals, max_num_seqs=8)
    assert r.first_token["b"] - 1 <= 2, "b waited for all of a's sequences"
    assert r.first_token["c"] - 4 <= 2
    for rid in ("a", "b"):
        assert all(r.tokens[(rid, i)] == 50 for i in range(8))


@pytest.mark.parametrize("max_num_seqs", [3, 8])
def test_one_sequence_per_request_is_plain_first_come_first_served(max_num_seqs):
    # nobody holds more than a share: no sequence is ever preempted for fairness, and requests start in order
    arrivals = [Arrival(step=0, request_id=f"r{i:02d}", n=1, max_tokens=5 + i % 3) for i in range(20)]
    r = run(arrivals, max_num_seqs=max_num_seqs)
    assert r.preempted == {}
    starts = [r.first_token[f"r{i:02d}"] for i in range(20)]
    assert starts == sorted(starts)
    assert len(r.finished) == 20
