"""How far any LoRA implementation could take the churn ratio: `python -m bench.churn_bound [--rate R] [--rounds N]`.

Runs `python -m bench.run --only churn-serving` (the serving traffic over 8 rank-8 adapters, then over
1,000 with `max_cpu_loras=64`; `max_loras=8` in both) twice per round at one arrival rate: once as
shipped, and once with the LoRA delta skipped (`Model._lora` does nothing; the scheduler, the slots,
the adapter loads and every other part of the step are unchanged, and each request still generates
its fixed number of tokens, so both runs keep their schedules). Rounds alternate which comes first.

What the figures mean:
- `churn / 8 adapters`, shipped: the issue's ratio (target 0.7);
- `churn without LoRA / 8 adapters as shipped`: an upper bound on that ratio for any implementation of
  the LoRA delta. A faster delta can make the churn run no faster than a free one, and can only make
  the 8-adapter run faster, which lowers the ratio;
- `churn without LoRA / 8 adapters without LoRA`: the schedule alone. Both runs do the same
  arithmetic on the same tokens; the churn run takes several times more, smaller steps because a
  step holds at most max_loras adapters (`python -m bench.slot_sim`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.assets import model_assets
from bench.churn import churn_serving_config, run_churn_serving
from bench.stats import environment

RESULTS = Path(__file__).resolve().parent / "results"


class LoraSwitch:
    """Model._lora as shipped, or skipped, chosen per run in this process."""

    def __init__(self) -> None:
        from loraledger.gpu.model import Model

        self._model = Model
        self._shipped = Model._lora
        self.skip = False

        def lora(model, *args, **kwargs):
            if not self.skip:
                self._shipped(model, *args, **kwargs)

        Model._lora = lora

    def restore(self) -> None:
        self._model._lora = self._shipped


def _run(switch: LoraSwitch, skip: bool, rate: float | None, threads: int) -> dict:
    switch.skip = skip
    report = run_churn_serving(model_assets(), churn_serving_config(rate, threads), log=lambda line: print(("  [no LoRA]" if skip else "  [shipped]") + line, flush=True))
    return {
        "rate": report["config"]["rate_used"],
        "baseline_seconds": report["baseline_8_adapters"]["seconds"],
        "churn_seconds": report["churn"]["seconds"],
        "baseline_tps": report["baseline_8_adapters"]["tokens_per_second"],
        "churn_tps": report["churn"]["tokens_per_second"],
        "baseline_steps": report["baseline_8_adapters"]["engine"]["steps"],
        "churn_steps": report["churn"]["engine"]["steps"],
        "churn_done": f"{report['churn']['requests_completed']}/{report['churn']['requests']}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.churn_bound", description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second (default: calibrated by the first run, then kept)")
    parser.add_argument("--rounds", type=int, default=1, help="shipped / no-LoRA pairs, alternating which runs first (default 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "churn-bound.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    switch = LoraSwitch()
    rate, runs = args.rate, {"shipped": [], "no_lora": []}
    started = time.perf_counter()
    try:
        for rnd in range(args.rounds):
            for skip in (False, True) if rnd % 2 == 0 else (True, False):
                run = _run(switch, skip, rate, args.threads)
                rate = run["rate"]
                runs["no_lora" if skip else "shipped"].append(run)
    finally:
        switch.restore()

    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[side])

    ratios = {
        "churn / 8 adapters, shipped (target >= 0.7)": med("shipped", "churn_tps") / med("shipped", "baseline_tps"),
        "churn without LoRA / 8 adapters shipped (bound for any LoRA delta)": med("no_lora", "churn_tps") / med("shipped", "baseline_tps"),
        "churn without LoRA / 8 adapters without LoRA (the schedule alone)": med("no_lora", "churn_tps") / med("no_lora", "baseline_tps"),
    }
    print(f"\nrate {rate:.2f} req/s, {args.rounds} round(s), {time.perf_counter() - started:.0f} s in all (medians over rounds)")
    for side, label in (("shipped", "shipped"), ("no_lora", "LoRA delta skipped")):
        print(f"  {label:<20} 8 adapters {med(side, 'baseline_seconds'):6.1f} s / {med(side, 'baseline_steps'):5.0f} steps"
              f"   churn {med(side, 'churn_seconds'):6.1f} s / {med(side, 'churn_steps'):5.0f} steps")
    for name, value in ratios.items():
        print(f"  {name:<70} {value:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"environment": environment(), "rate": rate, "threads": args.threads, "runs": runs, "ratios": ratios}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
