"""Run issue 6's benchmark in one process: `python -m bench.run [--only throughput|serving|churn-serving|churn] [--quick]`.

Prints a table of every scenario and ratio, and writes everything (with the engine-source hash,
since other work may be changing the engine while this runs) to bench/results/latest.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

# the engine's modules are imported before their files are hashed (bench.stats.environment), so the
# recorded hash is that of the code that runs, wherever it was imported from
import loraledger.engine_setup  # noqa: F401
import loraledger.gpu.backend  # noqa: F401
import loraledger.gpu.model_runner  # noqa: F401
from bench.assets import model_assets
from bench.churn import ChurnConfig, ChurnServingConfig, run_churn, run_churn_serving
from bench.serving import ServingConfig, run_serving
from bench.stats import environment
from bench.throughput import ThroughputConfig, run_throughput

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("throughput", "serving", "churn-serving", "churn")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=PARTS, help="run only this part (repeatable); default: all")
    parser.add_argument("--quick", action="store_true", help="small sizes and one repeat: a smoke test, not figures to quote")
    parser.add_argument("--repeats", type=int, default=None, help="measured calls per throughput scenario (default 3, --quick 1)")
    parser.add_argument("--serving-rate", type=float, default=None, help="arrivals per second in serving and churn-serving (default: 1.25 x measured capacity)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for every system (default 2)")
    parser.add_argument("--churn-max-loras", type=int, default=None, help="adapter slots in the churn scenario (default 8)")
    parser.add_argument("--churn-max-lora-rank", type=int, default=None, help="max_lora_rank in the churn scenario (default 8, the adapters' rank)")
    parser.add_argument("--no-audit", action="store_true", help="skip scenario 1a (scenario 1 with the SQLite audit store)")
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json")
    args = parser.parse_args(argv)
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

    report: dict = {"command": " ".join(["python -m bench.run", *(argv if argv is not None else sys.argv[1:])]), "started": time.time()}
    report["environment"] = environment()
    if report["environment"]["engine_imported_from_elsewhere"]:
        log(f"WARNING: engine modules imported from outside {Path(__file__).resolve().parent.parent}: "
            f"{report['environment']['engine_imported_from_elsewhere']} (check `pip show loraledger`)")
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
            (f"Serving: {s['workload']['requests']} requests at {s['config']['rate_used']:.2f} req/s, "
            f"{s['workload']['useful_tokens']} tokens"),
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
            extra = " ".join(f"{r[k]:7.3f}" if r.get(k) is not None else " " * 7 for k in ("best_value", "cpu_time_value"))
            lines.append(f"  {name:<48} {value:8.3f} {target:>10} {met:>5} {extra}" if math.isfinite(value) else f"  {name:<48} {'n/a':>8}")
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
