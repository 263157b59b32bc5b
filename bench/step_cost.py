"""What a step costs, with 8 adapters and under churn: `python -m bench.step_cost [--rate R]`.

Runs both halves of `python -m bench.run --only churn-serving` (the serving traffic over 8 rank-8
adapters, then over 1,000 with `max_cpu_loras=64`; `max_loras=8` in both) with a timer around every
step, and fits each run's step seconds as fixed + per decoding sequence + per prompt token (least
squares). The two runs generate the same tokens from the same prompts; the churn run needs several
times more steps (a step serves at most max_loras adapters), each smaller and each paying the fixed
part again. From the measured figures it then gives the fixed part per churn step at which the
churn run, with its step count unchanged, would reach 0.7 of the 8-adapter throughput:
fixed_needed = fixed - (churn seconds - 8-adapter seconds / 0.7) / churn steps.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from bench.assets import model_assets
from bench.churn import around_each_run, churn_serving_config, run_churn_serving
from bench.patching import wrap
from bench.slot_sim import StepCost, plan_work


def _timed_steps(log: list[tuple[float, int, int]]):
    def make(execute):
        def timed(runner, plan):
            started = time.perf_counter()
            try:
                return execute(runner, plan)
            finally:
                log.append((time.perf_counter() - started, *plan_work(plan)))

        return timed

    return make


def _measure(rate: float | None, threads: int) -> tuple[dict, dict[str, list[tuple[float, int, int]]]]:
    """bench.churn.run_churn_serving with a timer around every step; its report and each run's steps."""
    steps: list[tuple[float, int, int]] = []
    runs: list[list[tuple[float, int, int]]] = []
    wrap("loraledger.gpu.model_runner", "ModelRunner.execute", _timed_steps(steps))
    around_each_run(steps.clear, lambda: runs.append(list(steps)))
    report = run_churn_serving(model_assets(), churn_serving_config(rate, threads))
    return report, dict(zip(("baseline_8_adapters", "churn"), runs))


def fit_step_cost(steps: list[tuple[float, int, int]]) -> tuple[StepCost, float]:
    """Least-squares StepCost over (seconds, decoding sequences, prompt tokens) per step, and its R^2."""
    data = np.asarray(steps, dtype=np.float64)
    design = np.column_stack([np.ones(len(data)), data[:, 1], data[:, 2]])
    coef, *_ = np.linalg.lstsq(design, data[:, 0], rcond=None)
    residual = data[:, 0] - design @ coef
    r2 = 1.0 - float(residual @ residual) / float(((data[:, 0] - data[:, 0].mean()) ** 2).sum())
    return StepCost(float(coef[0]), float(coef[1]), float(coef[2])), r2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second (default: 1.25 x measured capacity, as bench.run)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report, runs = _measure(args.rate, args.threads)
    rate = report["config"]["rate_used"]
    figures: dict = {"rate": rate}
    print(f"serving traffic, no base requests, {rate:.2f} req/s")
    for name, steps in runs.items():
        cost, r2 = fit_step_cost(steps)
        seqs = float(np.mean([d for _, d, _ in steps]))
        seconds = report[name]["seconds"]
        figures[name] = {"seconds": seconds, "steps": len(steps), "mean_decoding_seqs": seqs, "cost": asdict(cost), "r2": r2}
        print(
            f"  {name:<19} {seconds:6.1f}s {len(steps):5d} steps ({seqs:4.1f} decoding seqs/step): step ~ {cost.fixed * 1e3:5.1f} ms"
            f" + {cost.per_seq * 1e3:.2f} ms/seq + {cost.per_prompt_token * 1e3:.3f} ms/prompt token  (R^2 {r2:.2f})"
        )
    base, churn = figures["baseline_8_adapters"], figures["churn"]
    ratio = base["seconds"] / churn["seconds"]
    needed = churn["cost"]["fixed"] - (churn["seconds"] - base["seconds"] / 0.7) / churn["steps"]
    figures.update(ratio=ratio, churn_fixed_for_0_7=needed)
    print(f"  ratio {ratio:.2f}; 0.7 at {churn['steps']} churn steps needs a fixed part of {needed * 1e3:.1f} ms per step")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
