"""Overlapped scheduling on against off, one workload, alternating rounds: `python -m bench.overlap [--device cpu|cuda]`.

The same engine settings twice but for `async_scheduling`: True plans and launches step N+1 while
step N runs (its inputs taken from step N's sampled ids on the device), False waits for each step's
tokens before planning the next. The workload is the throughput scenario's mixed batch on the CPU
bench model (32 prompts of 64 ids, 32 greedy new tokens, 8 adapters + base), or on `--device cuda`
gpu_decode's batch of 32 prompts over 32 adapters on the 1B-shaped bf16 model. Reports tokens/s per
round, the medians and their ratio, and on CUDA the device's idle share of each engine's steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.offline_engine import OfflineEngine
from bench.stats import environment, median


def _setup(device: str, threads: int):
    if device == "cuda":
        from bench.gpu_decode import NUM_ADAPTERS, RANK, gpu_assets, workload

        assets = gpu_assets()
        # the two engines are alive at once: each may take under half the device (gpu_memory_utilization)
        kwargs = dict(
            num_threads=None,
            max_loras=NUM_ADAPTERS,
            max_lora_rank=RANK,
            device="cuda",
            dtype="bfloat16",
            gpu_memory_utilization=0.45,
        )
        return assets.model_dir, assets.adapters, kwargs, workload(3, 64)
    from bench.bench_assets import model_assets
    from bench.workload import batch_workload

    assets = model_assets()
    work = batch_workload(1, num_prompts=32, prompt_len=64, max_tokens=32, vocab_size=assets.vocab_size, num_adapters=8)
    return assets.model_dir, assets.adapters, dict(num_threads=threads), work


def run(device: str, rounds: int, threads: int, log=print) -> dict:
    torch.set_num_threads(threads)
    model_dir, adapters, kwargs, work = _setup(device, threads)
    engines = {
        mode: OfflineEngine(model_dir, adapters, async_scheduling=mode == "on", **kwargs) for mode in ("on", "off")
    }
    runs: dict[str, list] = {"on": [], "off": []}
    try:
        for engine in engines.values():
            engine.register_all()
            engine.generate(work)  # warm-up: adapters in their slots, kernels compiled, graphs captured
        for r in range(rounds):
            for mode, engine in engines.items():
                runs[mode].append(engine.generate(work))
            log(
                f"round {r}: on {runs['on'][-1].tokens_per_second:.0f} tok/s, off {runs['off'][-1].tokens_per_second:.0f} tok/s"
            )
    finally:
        for engine in engines.values():
            engine.close()
    report = {"device": device, "rounds": rounds, "environment": environment()}
    for mode, rs in runs.items():
        gpu = sum(r.engine["gpu_seconds"] for r in rs)
        idle = sum(r.engine["gpu_idle_seconds"] for r in rs)
        report[mode] = {
            "tokens_per_second": [r.tokens_per_second for r in rs],
            "median": median([r.tokens_per_second for r in rs]),
            "gpu_idle_fraction": idle / (gpu + idle) if gpu + idle > 0 else None,
        }
    report["on_over_off"] = report["on"]["median"] / report["off"]["median"]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    report = run(args.device, args.rounds, args.threads)
    for mode in ("on", "off"):
        r = report[mode]
        idle = "" if r["gpu_idle_fraction"] is None else f", device idle {100 * r['gpu_idle_fraction']:.1f}%"
        print(
            f"async_scheduling {mode:<3}: median {r['median']:.0f} tok/s ({', '.join(f'{t:.0f}' for t in r['tokens_per_second'])}){idle}"
        )
    print(f"on / off: {report['on_over_off']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
