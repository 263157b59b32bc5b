"""The scheduling policy on a simulated clock, without a model or an executor.

Under adapter churn the schedule, not the forward pass, decides how many steps a run needs: a step
serves at most `max_loras` adapters. `simulate` calls the real `SchedulingPolicy` (add, schedule,
update) with a stand-in executor that "samples" a token for every sequence that asks for one and
advances a simulated clock by a step-cost model, adding the arrivals that fall inside a step before
its output is taken in, as the scheduler actor does in a live run. A few hundred requests take about
a second, so policies can be compared by the steps and slot loads they need (`python -m bench.run
--only schedule`) and the tests check slot turnover directly.

The step cost only sets how many arrivals land between steps; one model for every batch size makes
the simulated seconds indicative only: large steps cost less per sequence than small ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from loraledger.actors.messages import NewRequest
from loraledger.sampling_params import SamplingParams
from loraledger.scheduling.policy import SchedulingPolicy
from loraledger.scheduling.scheduler_config import SchedulerConfig
from loraledger.scheduling.step_plan import SampledToken, StepOutput, StepPlan


class Traffic(Protocol):
    """Requests to simulate: prompt ids, adapter index per request (None = base model), new tokens
    per request (all generated), and arrivals in seconds (None: everything at t = 0)."""

    prompts: Sequence[Sequence[int]]
    adapter_of: Sequence[int | None]
    max_tokens: Sequence[int]
    arrivals: Sequence[float] | None

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class StepCost:
    """Simulated seconds of one step: fixed + per decoding sequence + per prompt (or recompute) token."""

    fixed: float = 0.021
    per_seq: float = 0.0015
    per_prompt_token: float = 0.00055

    def seconds(self, plan: StepPlan) -> float:
        decode, prompt_tokens = plan_work(plan)
        return self.fixed + self.per_seq * decode + self.per_prompt_token * prompt_tokens


def plan_work(plan: StepPlan) -> tuple[int, int]:
    """(decoding sequences, prompt or recompute tokens) of a step: what StepCost charges for."""
    decode = sum(1 for w in plan.seqs if len(w.token_ids) == 1)
    return decode, sum(len(w.token_ids) for w in plan.seqs) - decode


@dataclass(frozen=True)
class SimResult:
    steps: int
    seconds: float  # simulated: first arrival to last finish
    steps_bound: int  # slot_steps_bound of the traffic
    slot_loads: int  # adapters copied into a slot (a reload counts again)
    distinct_adapters: int
    completed: int
    ttfts: list[float]  # simulated seconds from arrival to the end of the step that gave the first token


@dataclass(frozen=True)
class _Adapter:
    """What the policy reads from a checkpoint: its fingerprint (the slot key and prefix-cache salt)."""

    fingerprint: str


def simulate(workload: Traffic, max_loras: int, cost: StepCost = StepCost(), *, block_size: int = 16) -> SimResult:
    """Run `workload` (arrivals in seconds, adapter index per request, lengths) through the SchedulingPolicy."""
    longest = max(len(p) for p in workload.prompts) + max(workload.max_tokens)
    policy = SchedulingPolicy(
        SchedulerConfig(
            num_kv_blocks=len(workload) * -(-longest // block_size),  # KV never binds: slots are what is measured
            block_size=block_size,
            enable_prefix_caching=True,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            max_model_len=longest,
            max_loras=max_loras,
            seed=0,
        )
    )
    arrivals = workload.arrivals or [0.0] * len(workload)
    adapters = {a: _Adapter(f"adapter-{a}") for a in set(workload.adapter_of) if a is not None}
    clock = 0.0
    first_token: dict[str, float] = {}
    finished: dict[str, float] = {}

    def deliver_arrivals(upto: float, nxt: int) -> int:
        """Add every request that has arrived by `upto` (requests that arrive during a step are seen together,
        before the next step is planned, as the scheduler actor sees them)."""
        while nxt < len(workload) and arrivals[nxt] <= upto:
            adapter = workload.adapter_of[nxt]
            params = SamplingParams(max_tokens=workload.max_tokens[nxt], ignore_eos=True, temperature=0.0)
            policy.add(
                NewRequest(
                    audit_id=str(nxt),
                    prompt_token_ids=workload.prompts[nxt],
                    params=params,
                    lora_request=None,
                    checkpoint=None if adapter is None else adapters[adapter],
                    arrival_time=arrivals[nxt],
                    queued_time=arrivals[nxt],
                )
            )
            nxt += 1
        return nxt

    steps = slot_loads = nxt = 0
    while True:
        nxt = deliver_arrivals(clock, nxt)
        step = policy.schedule()
        if step is None:
            if nxt >= len(workload):
                break
            clock = arrivals[nxt]  # idle until the next arrival
            continue
        plan = step.plan
        steps += 1
        slot_loads += len(plan.slot_loads)
        clock += cost.seconds(plan)
        nxt = deliver_arrivals(clock, nxt)  # arrivals during the step are in before its output is taken in
        sampled = [SampledToken(seq_id=w.seq_id, token_id=5, logprob=0.0) for w in plan.seqs if w.sample]
        result = policy.update(step, StepOutput(step_id=plan.step_id, sampled=sampled))
        for update in result.updates:
            first_token.setdefault(update.audit_id, clock)
            if update.finish_reason is not None:
                finished[update.audit_id] = clock

    return SimResult(
        steps=steps,
        seconds=max(finished.values(), default=0.0) - min(arrivals),
        steps_bound=slot_steps_bound(workload, max_loras),
        slot_loads=slot_loads,
        distinct_adapters=len(adapters),
        completed=len(finished),
        ttfts=[first_token.get(str(i), math.inf) - arrivals[i] for i in range(len(workload))],
    )


def slot_steps_bound(workload: Traffic, max_loras: int) -> int:
    """Fewest steps any schedule needs when at most `max_loras` adapters run per step.

    A step gives a sequence at most one new token, so a request of N tokens needs N steps with its
    adapter in a slot (prefill included: it samples the first token). Each adapter therefore holds a
    slot for at least its longest request's N steps: steps >= ceil(sum over adapters of that N /
    max_loras), and never fewer than the longest request's N.
    """
    longest: dict[int, int] = {}
    for adapter, tokens in zip(workload.adapter_of, workload.max_tokens):
        if adapter is not None:
            longest[adapter] = max(longest.get(adapter, 0), tokens)
    return max(-(-sum(longest.values()) // max_loras), max(workload.max_tokens))
