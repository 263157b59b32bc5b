"""The engine's scheduling policy on a simulated clock, without a model: `python -m bench.run --only schedule`.

Under adapter churn the schedule, not the forward pass, decides how many steps a run needs: a step
serves at most `max_loras` adapters. This calls the real `SchedulingPolicy` (add, schedule, update)
with a stand-in executor that "samples" a token for every sequence that asks for one and advances a
simulated clock by a step-cost model, adding the arrivals that fall inside a step before its output
is taken in, as the scheduler actor does in a live run. A run of
the churn-serving traffic takes about a second instead of minutes, so scheduling policies can be
compared here by the steps and slot loads they need (then confirmed with `python -m bench.run
--only churn-serving`), and the test suite checks the policy's slot turnover on the churn-serving
traffic.

The step cost only sets how many arrivals land between steps; the default is close to this 2-core
machine's small churn steps (per-step timings of the churn runs, bench/RESULTS.md). One model for every batch
size makes the simulated seconds indicative only: large steps cost less per sequence than small ones.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np

from bench.churn import churn_serving_traffic, slot_steps_bound
from bench.serving import ServingConfig
from bench.workload import Workload
from loraledger.actors.messages import NewRequest
from loraledger.sampling_params import SamplingParams
from loraledger.scheduling.config import SchedulerConfig
from loraledger.scheduling.policy import SchedulingPolicy
from loraledger.scheduling.step_plan import SampledToken, StepOutput, StepPlan


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
    steps_bound: int  # bench.churn.slot_steps_bound of the workload
    slot_loads: int  # adapters copied into a slot (a reload counts again)
    distinct_adapters: int
    completed: int
    ttfts: list[float]  # simulated seconds from arrival to the end of the step that gave the first token


@dataclass(frozen=True)
class _Adapter:
    """What the policy reads from a checkpoint: its fingerprint (the slot key and prefix-cache salt)."""

    fingerprint: str


def simulate(workload: Workload, max_loras: int, cost: StepCost = StepCost(), *, block_size: int = 16) -> SimResult:
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


def churn_pair(
    rate: float, *, num_adapters: int = 1000, baseline_adapters: int = 8, vocab_size: int = 32000
) -> tuple[Workload, Workload]:
    """The churn-serving traffic at `rate` requests/s (bench.churn.run_churn_serving's): over
    `baseline_adapters`, then over `num_adapters`."""
    cfg = ServingConfig(base_share=0.0)
    return churn_serving_traffic(cfg, vocab_size, rate, baseline_adapters), churn_serving_traffic(
        cfg, vocab_size, rate, num_adapters
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run --only schedule", description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[5.4, 7.0, 9.8], help="arrival rates, requests/s")
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--fixed-ms", type=float, default=StepCost.fixed * 1e3, help="step cost: fixed part")
    parser.add_argument(
        "--per-seq-ms", type=float, default=StepCost.per_seq * 1e3, help="step cost: per decoding sequence"
    )
    parser.add_argument("--per-prompt-token-ms", type=float, default=StepCost.per_prompt_token * 1e3)
    args = parser.parse_args(argv)
    cost = StepCost(args.fixed_ms / 1e3, args.per_seq_ms / 1e3, args.per_prompt_token_ms / 1e3)
    print(
        f"step cost: {cost.fixed * 1e3:.1f} ms + {cost.per_seq * 1e3:.2f} ms/sequence + {cost.per_prompt_token * 1e3:.2f} ms/prompt token"
    )
    print(
        "  rate | 8 adapters: steps  slot loads | churn: steps  >= bound  slot loads/adapters  TTFT p50   max  (simulated s)"
    )
    for rate in args.rates:
        base_traffic, churn_traffic = churn_pair(rate)
        base = simulate(base_traffic, args.max_loras, cost)
        churn = simulate(churn_traffic, args.max_loras, cost)
        print(
            f"  {rate:4.1f} | {base.steps:17d} {base.slot_loads:11d} | {churn.steps:12d} {churn.steps_bound:8d}"
            f"  {churn.slot_loads:10d}/{churn.distinct_adapters:<8d} {np.median(churn.ttfts):8.1f} {max(churn.ttfts):5.1f}"
            f"  ({churn.completed}/{len(churn_traffic)} done)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
