"""TorchOps of an earlier commit against the working tree's, in one process: `python -m bench.ab_ops --rev REV`.

On this shared VM two runs of the same code differ by more than most changes to the device ops,
so a before/after figure is only worth quoting when both sides run in one process, alternating.
The earlier commit's gpu/ops_torch.py is read with `git show` and its TorchOps methods are swapped
in and out of the class between rounds (the engine keeps its one TorchOps object). Two views:

- `forward`: Model.forward on two fixed batches of the bench model with 8 rank-8 churn adapters in
  the slots (12 decode sequences; the same plus a 64-token prefill chunk), median ms per call over
  the rounds, and whether both sides' logits are bit-identical;
- `throughput`: throughput scenarios 1 (mixed adapters) and 3 (base only) through the engine, median
  seconds per call over the rounds, and (1)/(3) from those medians.

Which side runs first alternates between rounds: the first run after a swap pays for it.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

import loraledger.gpu.ops_torch as current_module
from bench.assets import model_assets

REPO = Path(__file__).resolve().parent.parent


def _methods(cls: type) -> dict[str, Callable]:
    return {k: v for k, v in vars(cls).items() if isinstance(v, types.FunctionType) and k != "__init__"}


def _ops_at(rev: str) -> dict[str, Callable]:
    """The TorchOps methods of gpu/ops_torch.py at `rev`."""
    source = subprocess.run(["git", "show", f"{rev}:gpu/ops_torch.py"], cwd=REPO, check=True, capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"ops_torch_at_{rev}", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return _methods(module.TorchOps)


class Sides:
    """Swaps TorchOps' methods between the two sides; an instance built by either keeps both sides' state."""

    def __init__(self, rev: str) -> None:
        self.methods = {rev: _ops_at(rev), "working tree": _methods(current_module.TorchOps)}

    def use(self, side: str) -> None:
        for name, fn in self.methods[side].items():
            setattr(current_module.TorchOps, name, fn)


def _alternate(sides: Sides, rounds: int, measure: Callable[[str], dict[str, float]]) -> dict[str, dict[str, list[float]]]:
    names = list(sides.methods)
    out: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for rnd in range(rounds):
        for side in names if rnd % 2 == 0 else names[::-1]:
            sides.use(side)
            for key, value in measure(side).items():
                out[side].setdefault(key, []).append(value)
    return out


def _forward(sides: Sides, rounds: int) -> None:
    from bench.forward_sizes import churn_slot_runner, decode_batch

    runner = churn_slot_runner(current_module.TorchOps())

    def batch(prefill: bool):
        return decode_batch(runner, 12, True, first_context=60, context_step=10, prefill_tokens=64 if prefill else 0)

    batches = {"12 decode": batch(False), "12 decode + 64-token prefill": batch(True)}
    logits: dict[tuple[str, str], torch.Tensor] = {}

    def measure(side: str) -> dict[str, float]:
        ms = {}
        for name, b in batches.items():
            for _ in range(3):
                logits[side, name] = runner.model.forward(b, runner.kv_cache)
            started = time.perf_counter()
            for _ in range(15):
                runner.model.forward(b, runner.kv_cache)
            ms[name] = (time.perf_counter() - started) / 15 * 1e3
        return ms

    with torch.inference_mode():
        out = _alternate(sides, rounds, measure)
    old, new = list(sides.methods)
    for name in batches:
        o, n = statistics.median(out[old][name]), statistics.median(out[new][name])
        same = torch.equal(logits[old, name], logits[new, name])
        print(f"  {name:<30} {old}: {o:7.2f} ms   {new}: {n:7.2f} ms   new/old {n / o:.3f}   logits identical: {same}")


def _throughput(sides: Sides, rounds: int) -> None:
    from bench.offline_engine import OfflineEngine
    from bench.throughput import WARMUP_SEED, ThroughputConfig, mixed_workload
    from bench.workload import base_only

    assets = model_assets()
    cfg = ThroughputConfig(num_threads=torch.get_num_threads())
    engine = OfflineEngine(assets.model_dir, assets.adapters, num_threads=cfg.num_threads)
    engine.register_all()
    engine.generate(mixed_workload(assets, cfg, WARMUP_SEED))
    counter = iter(range(10**6))

    def measure(side: str) -> dict[str, float]:
        workload = mixed_workload(assets, cfg, next(counter))
        return {"(1) mixed": engine.generate(workload).seconds, "(3) base": engine.generate(base_only(workload)).seconds}

    try:
        out = _alternate(sides, rounds, measure)
    finally:
        engine.close()
    for side, runs in out.items():
        mixed, base = statistics.median(runs["(1) mixed"]), statistics.median(runs["(3) base"])
        print(f"  {side:<14} (1) {mixed:.3f} s  (3) {base:.3f} s  (1)/(3) {base / mixed:.3f}"
              f"   (runs: {[round(x, 2) for x in runs['(1) mixed']]} / {[round(x, 2) for x in runs['(3) base']]})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab_ops", description=__doc__.splitlines()[0])
    parser.add_argument("--rev", required=True, help="the earlier commit, e.g. fc325bf")
    parser.add_argument("--view", choices=("forward", "throughput"), default="forward")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sides = Sides(args.rev)
    print(f"TorchOps at {args.rev} against the working tree, {args.view}, {args.rounds} alternating rounds", file=sys.stderr)
    (_forward if args.view == "forward" else _throughput)(sides, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
