"""What happens between two steps: `python -m bench.step_gaps [--device cpu|cuda] [--seqs 32] [--tokens 64] [--switch-interval S]`.

Engine time outside the forward pass is spent on the critical path from one ModelRunner.execute
to the next: the result's way back to the event loop, the Scheduler's update (_on_step_done),
the next _schedule, and the plan's way to the worker thread. This wraps those three functions
with timestamps (leaving the engine's code as it is) and prints the median of each gap over the
decode steps of one generate() call: the demo's model (built once, no download), `--seqs`
prompts of 100 random ids over the demo's three adapters, `--tokens` greedy tokens each.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.patching import wrap

_MARKS: list[tuple[str, float, float]] = []


def _timed_sync(name: str):
    def make(original):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            _MARKS.append((name, t0, time.perf_counter()))
            return out

        return call

    return make


def _timed_async(name: str):
    def make(original):
        async def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = await original(*args, **kwargs)
            _MARKS.append((name, t0, time.perf_counter()))
            return out

        return call

    return make


def gaps(marks: list[tuple[str, float, float]]) -> dict[str, float]:
    """Median milliseconds of each leg between consecutive execute() calls (the first 5 steps skipped)."""
    execs = [m for m in marks if m[0] == "execute"]
    dones = [m for m in marks if m[0] == "on_step_done"]
    scheds = [m for m in marks if m[0] == "schedule"]
    legs: dict[str, list[float]] = {k: [] for k in ("execute", "to loop", "on_step_done", "to schedule", "schedule", "to worker")}
    for this, following in zip(execs[5:], execs[6:]):
        done = next((m for m in dones if m[1] >= this[2]), None)
        sched = next((m for m in scheds if done is not None and m[1] >= done[2]), None)
        if done is None or sched is None or sched[2] > following[1]:
            continue
        legs["execute"].append(this[2] - this[1])
        legs["to loop"].append(done[1] - this[2])
        legs["on_step_done"].append(done[2] - done[1])
        legs["to schedule"].append(sched[1] - done[2])
        legs["schedule"].append(sched[2] - sched[1])
        legs["to worker"].append(following[1] - sched[2])
    return {k: 1e3 * statistics.median(v) for k, v in legs.items() if v}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_gaps", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--switch-interval", type=float, help="sys.setswitchinterval(SECONDS) for the run")
    args = parser.parse_args(argv)
    if args.switch_interval is not None:
        import sys

        sys.setswitchinterval(args.switch_interval)

    import torch

    from loraledger import LLM, LoRARequest, SamplingParams
    from loraledger.commands import demo_assets

    wrap("loraledger.gpu.model_runner", "ModelRunner.execute", _timed_sync("execute"))
    wrap("loraledger.actors.scheduler", "Scheduler._schedule", _timed_sync("schedule"))
    wrap("loraledger.actors.scheduler", "Scheduler._on_step_done", _timed_async("on_step_done"))
    if args.device == "cpu":
        torch.set_num_threads(1)
    model_dir, adapter_dirs = demo_assets(Path(tempfile.gettempdir()) / "loraledger-step-gaps")
    loras = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(sorted(adapter_dirs.items()))]
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    bindings = [loras[i % len(loras)] for i in range(args.seqs)]

    def prompts():
        return [{"prompt_token_ids": [rng.randrange(4, 1000) for _ in range(100)]} for _ in range(args.seqs)]

    with LLM(
        model=str(model_dir), device=args.device, enable_lora=True, max_loras=len(loras), max_lora_rank=16,
        audit_url=None, seed=0,
    ) as llm:
        llm.generate(prompts(), params, lora_request=bindings)  # warm-up
        _MARKS.clear()
        llm.generate(prompts(), params, lora_request=bindings)
    legs = gaps(list(_MARKS))
    outside = sum(v for k, v in legs.items() if k != "execute")
    print(f"{args.seqs} sequences on {args.device}, median ms per decode step:")
    for name, ms in legs.items():
        print(f"  {name:<14} {ms:7.3f}")
    print(f"  outside execute: {outside:.3f} ms ({100 * outside / (outside + legs['execute']):.1f}% of a step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
