"""The churn-serving traffic through the scheduling policy on a simulated clock: `python -m bench.run --only schedule`.

loraledger.scheduling.simulator runs the real SchedulingPolicy with a stand-in executor; this prints the
steps and slot loads it needs on the churn-serving traffic at several rates (about a second per run), so
scheduling policies can be compared before confirming with `python -m bench.run --only churn-serving`.
The default step cost is close to this 2-core machine's small churn steps (per-step timings of the
churn runs, bench/RESULTS.md).
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.churn import churn_serving_traffic
from bench.serving import ServingConfig
from bench.workload import Workload
from loraledger.scheduling.simulator import StepCost, simulate


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
