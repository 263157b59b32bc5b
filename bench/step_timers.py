"""Wall seconds per part of the step, unprofiled: `python -m bench.run --only step-parts --scenario mixed|base|churn|churn-baseline|churn-serving`.

Wraps the engine's step functions (the forward, the base projections, the LoRA delta, attention,
the small device ops, sampling, batch building, adapter slot loads) with perf_counter timers in
this process and runs one measured generate() after a warm-up. Unlike bench.profile_step (`--only profile`) it adds
only a perf_counter pair per wrapped call, so the parts' seconds are comparable across scenarios: `mixed` and `base` are throughput scenarios 1 and 3 (three interleaved pairs, best of
each), `churn` and `churn-baseline` the offline adapter-churn runs of bench.churn, and
`churn-serving` both runs of `python -m bench.run --only churn-serving` (8 adapters, then 1,000),
reported per step as well, since the two runs take very different numbers of steps.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from dataclasses import replace

import torch

from bench.bench_assets import churn_adapters, model_assets
from bench.churn import ChurnConfig, around_each_run, churn_serving_config, churn_workload, run_churn_serving
from bench.offline_engine import OfflineEngine
from bench.patching import wrap
from bench.throughput import ThroughputConfig, mixed_workload
from bench.workload import base_only

# (module, owner.attribute, label); owner "" = a module-level function
_PARTS = (
    ("loraledger.gpu.model_runner", "ModelRunner.execute", "step (runner.execute)"),
    ("loraledger.gpu.model", "Model.forward", "forward"),
    ("loraledger.gpu.dense", "Dense.__call__", "base projections (Dense)"),
    ("loraledger.gpu.model", "Model._lora", "LoRA delta"),
    ("loraledger.gpu.ops_torch", "TorchOps.paged_attention_decode", "decode attention"),
    ("loraledger.gpu.ops_torch", "TorchOps.prefill_attention", "prefill attention"),
    ("loraledger.gpu.ops_torch", "TorchOps.rms_norm", "rms_norm"),
    ("loraledger.gpu.ops_torch", "TorchOps.rotary_embedding", "rotary"),
    ("loraledger.gpu.ops_torch", "TorchOps.silu_and_mul", "silu_and_mul"),
    ("loraledger.gpu.ops_torch", "TorchOps.write_kv", "write_kv"),
    ("loraledger.gpu.model_runner", "ModelRunner._sample", "sampling"),
    ("loraledger.gpu.model_runner", "build_forward_batch", "batch building"),
    ("loraledger.gpu.ops_torch", "TorchOps.lora_prepare", "LoRA planning"),
    ("loraledger.gpu.model_runner", "ModelRunner._apply_slot_changes", "adapter slot loads"),
)


class Timers:
    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def install(self) -> None:
        for module_name, path, label in _PARTS:
            wrap(module_name, path, functools.partial(self._timed, label=label))

    def _timed(self, fn, label: str):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - started
                self.calls[label] += 1

        return timed

    def snapshot(self) -> dict[str, tuple[float, int]]:
        return {label: (self.seconds[label], self.calls[label]) for _, _, label in _PARTS}

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run --only step-parts", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scenario", choices=("mixed", "base", "churn", "churn-baseline", "churn-serving"), default="mixed"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rate", type=float, default=None, help="churn-serving: requests/s (default: calibrated)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    timers = Timers()
    timers.install()
    assets = model_assets()
    if args.scenario == "churn-serving":
        return _churn_serving(assets, timers, args.threads, args.rate)
    if args.scenario in ("mixed", "base"):
        cfg = ThroughputConfig(num_threads=args.threads)
        engine = OfflineEngine(assets.model_dir, assets.adapters, num_threads=args.threads)
        engine.register_all()

        def workload(seed: int):
            w = mixed_workload(assets, cfg, seed)
            return w if args.scenario == "mixed" else base_only(w)

        engine.generate(workload(10_000))
        best = None
        for seed in range(3):
            timers.reset()
            run = engine.generate(workload(seed))
            if best is None or run.seconds < best[0]:
                best = (run.seconds, run.engine["steps"], timers.snapshot())
    else:
        cfg = ChurnConfig(num_threads=args.threads)
        count = cfg.num_adapters if args.scenario == "churn" else cfg.baseline_adapters
        engine = OfflineEngine(
            assets.model_dir,
            churn_adapters(cfg.num_adapters)[:count],
            num_threads=args.threads,
            max_loras=cfg.max_loras,
            max_lora_rank=cfg.max_lora_rank,
            max_cpu_loras=max(
                cfg.max_cpu_loras if args.scenario == "churn" else count, cfg.max_loras
            ),  # as bench.churn
            name_prefix="churn-",
        )
        engine.register_all()
        engine.generate(churn_workload(replace(cfg, seed=cfg.seed + 100, num_requests=32), assets.vocab_size, count))
        timers.reset()
        run = engine.generate(churn_workload(cfg, assets.vocab_size, count))
        best = (run.seconds, run.engine["steps"], timers.snapshot())
    engine.close()
    seconds, steps, parts = best
    print(f"scenario {args.scenario}: generate() {seconds:.2f}s, {int(steps)} steps")
    for label, (spent, calls) in parts.items():
        print(f"  {label:<28} {spent:8.3f}s  calls {calls}")
    return 0


def _churn_serving(assets, timers: Timers, threads: int, rate: float | None) -> int:
    """Both churn-serving runs, each measured run's parts kept apart (the capacity probes are not counted)."""
    snapshots: list[dict[str, tuple[float, int]]] = []
    around_each_run(timers.reset, lambda: snapshots.append(timers.snapshot()))
    results = run_churn_serving(assets, churn_serving_config(rate, threads), log=lambda line: None)
    for name, parts in zip(("baseline_8_adapters", "churn"), snapshots):
        run = results[name]
        steps = parts["step (runner.execute)"][1]
        print(f"{name}: {run['seconds']:.2f}s, {steps} steps, {run['tokens_per_second']:.1f} tok/s")
        for label, (spent, calls) in parts.items():
            print(f"  {label:<28} {spent:8.3f}s  {spent / max(steps, 1) * 1e3:7.2f} ms/step  calls {calls}")
    for label, ratio in results["ratios"].items():
        print(f"{label}: {ratio['value']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
