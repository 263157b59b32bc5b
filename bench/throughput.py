"""Scenarios 1-4: offline batch throughput of loraledger vs transformers (+PEFT), mixed adapters and base only.

The same seeded prompts go through every system. Each system gets one warm-up call, then the
repeats are interleaved (repeat r runs every scenario on prompt set r before repeat r + 1 starts),
so that a burst of load on the shared machine hits all systems alike rather than one of them.
Every repeat uses fresh random prompts: a repeated prompt would let loraledger's prefix cache skip
its prefill, which transformers cannot do. Throughput = generated tokens / wall seconds of the
generate call (engine build and model load excluded), reported at the median of the repeats.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.bench_assets import BenchAssets
from bench.hf_baseline import HFModel
from bench.offline_engine import OfflineEngine
from bench.stats import add_deltas, median
from bench.workload import Workload, base_only, batch_workload

WARMUP_SEED = 10_000


@dataclass(frozen=True)
class ThroughputConfig:
    num_prompts: int = 32
    prompt_len: int = 64
    new_tokens: int = 32
    repeats: int = 3
    num_threads: int = 2
    with_audit: bool = True  # also run scenario 1 with a SQLite audit store (the cost of auditing)


@dataclass(frozen=True)
class Scenario:
    key: str
    label: str
    run: Callable[
        [Workload], object
    ]  # returns an object with .seconds, .tokens, .token_ids (and .engine for loraledger)


@dataclass
class HFRun:
    seconds: float
    cpu_seconds: float
    tokens: int
    token_ids: list[list[int]]


def hf_generate(model: HFModel, workload: Workload) -> HFRun:
    new_tokens = max(workload.max_tokens)
    started, cpu_started = time.perf_counter(), time.process_time()
    out = model.generate(workload.prompts, workload.adapter_of, new_tokens)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    return HFRun(seconds=seconds, cpu_seconds=cpu_seconds, tokens=int(out.numel()), token_ids=out.tolist())


def mixed_workload(assets: BenchAssets, cfg: ThroughputConfig, seed: int) -> Workload:
    """Scenario 1's prompts and bindings for one seed (scenario 3 runs base_only() of it)."""
    return batch_workload(
        seed,
        num_prompts=cfg.num_prompts,
        prompt_len=cfg.prompt_len,
        max_tokens=cfg.new_tokens,
        vocab_size=assets.vocab_size,
        num_adapters=len(assets.adapters),
    )


def run_throughput(assets: BenchAssets, cfg: ThroughputConfig, log: Callable[[str], None] = print) -> dict:
    def workload(seed: int) -> Workload:
        return mixed_workload(assets, cfg, seed)

    closers = []
    with tempfile.TemporaryDirectory(prefix="loraledger-bench-") as tmp:
        try:
            log("building loraledger engine(s) and loading the HF models (not timed)")
            ll = OfflineEngine(assets.model_dir, assets.adapters, num_threads=cfg.num_threads)
            closers.append(ll.close)
            hf_peft = HFModel(assets.model_dir, assets.adapters)
            hf_base = HFModel(assets.model_dir)
            scenarios = [
                Scenario("1", "loraledger, mixed adapters", ll.generate),
                Scenario("2", "HF + PEFT, mixed adapters", lambda w: hf_generate(hf_peft, w)),
                Scenario("3", "loraledger, base only", lambda w: ll.generate(base_only(w))),
                Scenario("4", "HF, base only", lambda w: hf_generate(hf_base, base_only(w))),
            ]
            if cfg.with_audit:
                audit_url = f"sqlite:///{Path(tmp) / 'bench.db'}"
                ll_audit = OfflineEngine(
                    assets.model_dir, assets.adapters, num_threads=cfg.num_threads, audit_url=audit_url
                )
                closers.append(ll_audit.close)
                scenarios.append(Scenario("1a", "loraledger, mixed adapters, SQLite audit on", ll_audit.generate))
            results = _measure(scenarios, workload, cfg.repeats, log)
        finally:
            for close in reversed(closers):
                close()
    return _summarise(scenarios, results, cfg)


def _measure(scenarios: list[Scenario], workload: Callable[[int], Workload], repeats: int, log) -> dict[str, list]:
    warm = workload(WARMUP_SEED)
    for s in scenarios:
        started = time.perf_counter()
        s.run(warm)
        log(f"  warm-up {s.key:>2} ({s.label}): {time.perf_counter() - started:.2f}s")
    runs: dict[str, list] = {s.key: [] for s in scenarios}
    for r in range(repeats):
        w = workload(r)
        for s in scenarios:
            run = s.run(w)
            runs[s.key].append(run)
            log(
                f"  repeat {r} scenario {s.key:>2}: {run.seconds:7.2f}s  {run.tokens / run.seconds:8.1f} tok/s  (cpu {run.cpu_seconds:6.2f}s)"
            )
    return runs


def _agreement(a: list, b: list) -> float:
    """Share of prompts, over all repeats, whose generated ids are identical in both runs lists."""
    same = total = 0
    for ra, rb in zip(a, b):
        for x, y in zip(ra.token_ids, rb.token_ids):
            same += list(x) == list(y)
            total += 1
    return same / total if total else float("nan")


def _summarise(scenarios: list[Scenario], runs: dict[str, list], cfg: ThroughputConfig) -> dict:
    out: dict = {"config": cfg.__dict__, "scenarios": {}, "ratios": {}}
    tps: dict[str, float] = {}
    best_tps: dict[str, float] = {}  # fastest repeat: the least disturbed by other processes
    cpu_tps: dict[str, float] = {}  # a cross-check on the wall-clock ratios, which other load on the machine skews
    for s in scenarios:
        rs = runs[s.key]
        seconds = [r.seconds for r in rs]
        med = median(seconds)
        tokens = rs[0].tokens
        tps[s.key] = tokens / med
        cpu_med = median([r.cpu_seconds for r in rs])
        cpu_tps[s.key] = tokens / cpu_med
        best_tps[s.key] = tokens / min(seconds)
        entry = {
            "label": s.label,
            "seconds": seconds,
            "median_seconds": med,
            "best_seconds": min(seconds),
            "best_tokens_per_second": tokens / min(seconds),
            "cpu_seconds": [r.cpu_seconds for r in rs],
            "median_cpu_seconds": cpu_med,
            "tokens_per_cpu_second": cpu_tps[s.key],
            "generated_tokens": tokens,
            "tokens_per_second": tps[s.key],
        }
        if hasattr(rs[0], "engine"):
            entry["engine_stats"] = add_deltas([r.engine for r in rs])
            # the engine's own overhead_fraction counts only time inside steps; this one is the whole call
            entry["forward_share_of_call"] = entry["engine_stats"]["forward_seconds"] / sum(seconds)
        out["scenarios"][s.key] = entry

    def ratio(name: str, num: str, den: str, target: float | None, op: str = ">=") -> None:
        if num in tps and den in tps:
            value = tps[num] / tps[den]
            out["ratios"][name] = {
                "value": value,
                "target": target,
                "op": op,
                "met": None if target is None else value >= target,
                "cpu_time_value": cpu_tps[num] / cpu_tps[den],
                "best_value": best_tps[num] / best_tps[den],
            }

    ratio("(1)/(2) mixed: loraledger vs HF+PEFT", "1", "2", 2.2)
    ratio("(1)/(3) loraledger mixed vs base", "1", "3", 0.85)
    ratio("(3)/(4) base: loraledger vs HF", "3", "4", 1.0)
    ratio("(1a)/(1) audit on vs off", "1a", "1", None)
    ratio("(1a)/(2) audited mixed vs HF+PEFT", "1a", "2", None)
    if "1" in out["scenarios"]:
        overhead = out["scenarios"]["1"]["engine_stats"]["overhead_fraction"]
        out["ratios"]["engine overhead_fraction, scenario 1"] = {
            "value": overhead,
            "target": 0.10,
            "op": "<",
            "met": overhead < 0.10,
        }
    out["token_agreement"] = {
        "(1) vs (2)": _agreement(runs["1"], runs["2"]),
        "(3) vs (4)": _agreement(runs["3"], runs["4"]),
        **({"(1a) vs (1)": _agreement(runs["1a"], runs["1"])} if "1a" in runs else {}),
    }
    return out
