"""End-to-end GPU figures: batch-32 decode with 32 distinct adapters, against the same engine without adapters and HF + PEFT.

Run by hand on a GPU:  python -m bench.gpu_decode [--new-tokens 64] [--repeats 3] [--json out.json]

Model: Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 query / 8 KV heads of 64, intermediate
8192, vocab 128,256, tied embeddings) with random bf16 weights, and 32 rank-16 adapters on all
seven projections, built on the machine under bench/.cache/gpu/ on first use. Every system gets
the same 32 prompts of 128 random token ids and generates `--new-tokens` greedy tokens for each
(ignore_eos / min_new_tokens), prompt j bound to adapter j:
  A  loraledger, 32 distinct adapters (max_loras=32, bf16, CUDA graphs for decode)
  B  loraledger, the same engine, the same prompts without adapters
  A' A's engine on C's shorter workload (`--hf-new-tokens`, default 16: HF + PEFT's mixed batch
     is too slow for the long one within a device lease)
  C  HF transformers + PEFT, one mixed-adapter generate(..., adapter_names=[...]) call (bf16)
  D  HF transformers, base model
  with --eager, A and B again with enforce_eager=True (every kernel launched from Python)
  with --sync, A and B again with async_scheduling=False (each step planned after the last one's tokens)
  with --batch N, A and B at batch N as well (prompts bound round-robin to the 32 adapters and the base)
Throughput = generated tokens / wall seconds of the generate call (model loads and warm-up
excluded); A and B alternate over fresh prompts for `--repeats` rounds and report medians.
Targets: A/B >= 0.9, A'/C >= 5, and the engine's time on the critical path (the share of a step's
wall time the device spends not working: 1 - device time per step from the runner's CUDA events /
wall time per step) under 5 %.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.bench_assets import CACHE, build_once, random_adapters, write_tokenizer
from bench.kernels import no_gpu
from bench.stats import environment, median
from bench.workload import Workload, base_only, batch_workload
from loraledger.assets import build_random_checkpoint

SHAPE = dict(
    arch="llama",
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    vocab_size=128_256,
    max_position_embeddings=2048,
    seed=7,
    dtype=torch.bfloat16,
    tie_word_embeddings=True,
)
NUM_ADAPTERS = 32
RANK = 16
PROMPT_LEN = 128


@dataclass(frozen=True)
class GpuAssets:
    model_dir: Path
    adapters: list[Path]


def gpu_assets(cache: Path = CACHE / "gpu") -> GpuAssets:
    def write_model(out: Path) -> None:
        build_random_checkpoint(out, **SHAPE)
        write_tokenizer(out, int(SHAPE["vocab_size"]))

    model_dir = build_once(cache / "llama-1b-shape", write_model)
    names = [f"r{RANK}-{i:02d}" for i in range(NUM_ADAPTERS)]
    adapters = random_adapters(model_dir, cache / "adapters", names, rank=RANK, first_seed=9000)
    return GpuAssets(model_dir, adapters)


def workload(seed: int, new_tokens: int, batch: int = NUM_ADAPTERS) -> Workload:
    """`batch` prompts bound round-robin to adapters 0..31 (at 32, each prompt its own)."""
    return batch_workload(
        seed,
        num_prompts=batch,
        prompt_len=PROMPT_LEN,
        max_tokens=new_tokens,
        vocab_size=int(SHAPE["vocab_size"]),
        num_adapters=NUM_ADAPTERS,
    )


def _hf_run(model, w: Workload) -> dict:
    torch.cuda.synchronize()
    started = time.perf_counter()
    out = model.generate(w.prompts, w.adapter_of, max(w.max_tokens))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "tokens": int(out.numel()), "token_ids": out.tolist()}


def _engine_runs(
    engine,
    new_tokens: int,
    repeats: int,
    log,
    switch_intervals: tuple[float, ...] = (),
    batches: tuple[int, ...] = (NUM_ADAPTERS,),
) -> dict[str, list]:
    """A and B alternating over fresh prompts, at each batch size (keys "A", "B" at 32, "A/64", "B/64", ...);
    with switch_intervals, each round runs A and B at 32 once per interval (sys.setswitchinterval: how long a
    thread holding the GIL keeps it from a waiting one)."""
    engine.register_all()
    for seed in (900, 901):  # warm-up: kernels compiled, graphs captured, every adapter in a slot
        for batch in batches:
            engine.generate(workload(seed, 8, batch))
            engine.generate(base_only(workload(seed, 8, batch)))
    default = sys.getswitchinterval()
    runs: dict[str, list] = {}
    try:
        for r in range(repeats):
            for batch in batches:
                w = workload(r, new_tokens, batch)
                intervals = (None, *switch_intervals) if batch == NUM_ADAPTERS else (None,)
                for interval in intervals:
                    sys.setswitchinterval(default if interval is None else interval)
                    suffix = ("" if batch == NUM_ADAPTERS else f"/{batch}") + (
                        "" if interval is None else f"@{interval * 1e3:g}ms"
                    )
                    for key, load in (("A", w), ("B", base_only(w))):
                        runs.setdefault(key + suffix, []).append(engine.generate(load))
                    log(
                        f"round {r}{suffix}: A {runs['A' + suffix][-1].tokens_per_second:.0f} tok/s, B {runs['B' + suffix][-1].tokens_per_second:.0f} tok/s"
                    )
    finally:
        sys.setswitchinterval(default)
    return runs


def _summary(label: str, rs: list) -> dict:
    """Medians of the runs, and the engine's per-step figures summed over them: the device's busy time per
    step (CUDA events) and the share of the step's wall time the device spent waiting for the engine."""
    steps = sum(r.engine["steps"] for r in rs)
    wall = sum(r.engine["wall_seconds"] for r in rs)
    forward = sum(r.engine["forward_seconds"] for r in rs)
    gpu = sum(r.engine["gpu_seconds"] for r in rs)
    idle = sum(r.engine["gpu_idle_seconds"] for r in rs)
    return {
        "label": label,
        "seconds": median([r.seconds for r in rs]),
        "tokens_per_second": median([r.tokens_per_second for r in rs]),
        "step_ms": 1e3 * wall / steps,
        "forward_ms": 1e3 * forward / steps,
        "gpu_ms": 1e3 * gpu / steps,
        "overhead_fraction": 1.0 - forward / wall,
        "engine_critical_fraction": 1.0 - gpu / wall if wall > 0 else 0.0,
        "gpu_idle_fraction": idle / (gpu + idle) if gpu + idle > 0 else 0.0,
    }


def run(
    new_tokens: int,
    repeats: int,
    hf_new_tokens: int,
    eager: bool,
    switch_intervals: tuple[float, ...] = (),
    batches: tuple[int, ...] = (NUM_ADAPTERS,),
    one_step_at_a_time: bool = False,
    log=print,
) -> dict:
    from bench.hf_baseline import HFModel
    from bench.offline_engine import OfflineEngine

    started = time.perf_counter()
    assets = gpu_assets()
    log(f"assets ready in {time.perf_counter() - started:.1f} s: {assets.model_dir}")
    results: dict[str, dict] = {}
    kwargs = dict(num_threads=None, max_loras=NUM_ADAPTERS, max_lora_rank=RANK, device="cuda", dtype="bfloat16")
    short = workload(0, hf_new_tokens)
    engine = OfflineEngine(assets.model_dir, assets.adapters, **kwargs)
    try:
        runs = _engine_runs(engine, new_tokens, repeats, log, switch_intervals, batches)
        results["A"] = _summary("loraledger, 32 distinct adapters", runs["A"])
        results["B"] = _summary("loraledger, no adapters", runs["B"])
        for key in sorted(k for k in runs if k not in ("A", "B")):
            label = "32 adapters" if key.startswith("A") else "no adapters"
            batch = key.split("@")[0].partition("/")[2] or str(NUM_ADAPTERS)
            switch = f", GIL switch {key.split('@')[1]}" if "@" in key else ""
            results[key] = _summary(f"loraledger, {label}, batch {batch}{switch}", runs[key])
        a_short = engine.generate(short)
        results["A'"] = _summary(f"loraledger, 32 adapters, {hf_new_tokens} tokens", [a_short])
    finally:
        engine.close()
    if eager:
        engine = OfflineEngine(assets.model_dir, assets.adapters, enforce_eager=True, **kwargs)
        try:
            runs = _engine_runs(engine, new_tokens, 1, log)
            results["A_eager"] = _summary("loraledger eager, 32 adapters", runs["A"])
            results["B_eager"] = _summary("loraledger eager, no adapters", runs["B"])
        finally:
            engine.close()
    if one_step_at_a_time:
        engine = OfflineEngine(assets.model_dir, assets.adapters, async_scheduling=False, **kwargs)
        try:
            runs = _engine_runs(engine, new_tokens, repeats, log)
            results["A_sync"] = _summary("loraledger, one step at a time, 32 adapters", runs["A"])
            results["B_sync"] = _summary("loraledger, one step at a time, no adapters", runs["B"])
        finally:
            engine.close()
    torch.cuda.empty_cache()

    hf_peft = HFModel(assets.model_dir, assets.adapters, dtype=torch.bfloat16, device="cuda")
    _hf_run(hf_peft, workload(900, 2))
    c = _hf_run(hf_peft, short)
    results["C"] = {
        "label": f"HF + PEFT, mixed, {hf_new_tokens} tokens",
        **c,
        "tokens_per_second": c["tokens"] / c["seconds"],
    }
    del hf_peft
    torch.cuda.empty_cache()
    hf_base = HFModel(assets.model_dir, dtype=torch.bfloat16, device="cuda")
    _hf_run(hf_base, base_only(workload(900, 2)))
    d = _hf_run(hf_base, base_only(short))
    results["D"] = {
        "label": f"HF, base model, {hf_new_tokens} tokens",
        **d,
        "tokens_per_second": d["tokens"] / d["seconds"],
    }
    del hf_base

    a_ids, c_ids = a_short.token_ids, results["C"].pop("token_ids")
    results["D"].pop("token_ids")
    same = sum(x == y for a, c in zip(a_ids, c_ids) for x, y in zip(a, c))
    tps = {k: v["tokens_per_second"] for k, v in results.items()}
    return {
        "device": torch.cuda.get_device_name(),
        "new_tokens": new_tokens,
        "hf_new_tokens": hf_new_tokens,
        "repeats": repeats,
        "systems": results,
        "ratios": {"A/B": tps["A"] / tps["B"], "A'/C": tps["A'"] / tps["C"]},
        "targets": {"A/B": 0.9, "A'/C": 5.0, "engine_critical_fraction": 0.05, "gpu_idle_fraction": 0.05},
        "a_vs_c_same_token_share": same / max(1, sum(len(a) for a in a_ids)),
        "environment": environment(),
    }


def _table(report: dict) -> str:
    lines = [
        f"device: {report['device']}, batch 32 unless named, prompt {PROMPT_LEN}, {report['new_tokens']} new tokens, bf16"
    ]
    lines.append(
        f"{'system':<62} {'seconds':>8} {'tok/s':>8} {'step ms':>8} {'GPU ms':>7} {'engine':>7} {'GPU idle':>9}"
    )
    for key, r in report["systems"].items():
        extra = ""
        if "step_ms" in r:
            extra = (
                f" {r['step_ms']:>8.2f} {r['gpu_ms']:>7.2f} {100 * r['engine_critical_fraction']:>6.1f}%"
                f" {100 * r['gpu_idle_fraction']:>8.1f}%"
            )
        lines.append(f"{key:<10} {r['label']:<51} {r['seconds']:>8.2f} {r['tokens_per_second']:>8.0f}{extra}")
    ratios = ", ".join(f"{k} {v:.2f}" for k, v in report["ratios"].items())
    lines.append("engine: share of a step's wall time the device was not working (1 - GPU ms / step ms); target < 5%")
    lines.append(f"ratios: {ratios} (targets: A/B >= 0.9, A'/C >= 5)")
    lines.append(f"A' and C agree on {100 * report['a_vs_c_same_token_share']:.1f}% of greedy tokens (bf16 both)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_decode", description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--hf-new-tokens", type=int, default=16, help="new tokens in the HF runs (C, D) and in A' (default 16)"
    )
    parser.add_argument(
        "--eager", action="store_true", help="also run A and B with enforce_eager=True (no CUDA graphs)"
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        action="append",
        default=[],
        help="also run A and B with sys.setswitchinterval(SECONDS) (repeatable)",
    )
    parser.add_argument(
        "--batch", type=int, action="append", default=[], help="also run A and B at this batch size (repeatable)"
    )
    parser.add_argument(
        "--sync", action="store_true", help="also run A and B with async_scheduling=False (one step at a time)"
    )
    parser.add_argument("--json", type=Path, help="also write the report to this JSON file")
    args = parser.parse_args(argv)
    if no_gpu("bench.gpu_decode"):
        return 2
    batches = (NUM_ADAPTERS, *(b for b in args.batch if b != NUM_ADAPTERS))
    report = run(
        args.new_tokens, args.repeats, args.hf_new_tokens, args.eager, tuple(args.switch_interval), batches, args.sync
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
