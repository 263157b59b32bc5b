"""Adapter churn: requests drawn Zipf-like over 1,000 registered rank-8 adapters, with a 64-adapter host cache.

Every adapter is registered with add_lora() first (not timed; the host LRU keeps only
max_cpu_loras of them, so most requests need a disk reload and then a device slot). The same
requests then run with their adapters drawn over only 8 adapters of the same rank and targets: the
throughput ratio is the cost of churn alone. Each request's queue wait = scheduled_ts -
arrival_time; the maximum shows whether any adapter's requests starve behind the popular ones.

Two forms, each against its own 8-adapter run with the same requests:
- serving (`run_churn_serving`, the scenario the churn figures are quoted for): the serving scenario's traffic (Poisson
  arrivals at 1.25x the engine's measured batch-32 capacity, output lengths 8-128) with the
  adapters drawn over all 1,000, streamed through an AsyncEngine;
- offline batch (`run_churn`): all 256 requests submitted at once, 32 tokens each, through
  LLM.generate: the worst case, where max_loras bounds how many requests can share a step (at
  least distinct adapters x tokens / max_loras steps against tokens + 1 for the baseline).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import anyio
import numpy as np

from bench.bench_assets import CHURN_RANK, BenchAssets, churn_adapters
from bench.offline_engine import OfflineEngine, OfflineRun
from bench.patching import wrap
from bench.serving import ServingConfig, arrival_rate, measure_capacity, serving_traffic, stream_workload
from bench.stats import percentiles
from bench.workload import Workload, random_prompts, zipf_choices
from loraledger.scheduling.simulator import slot_steps_bound


@dataclass(frozen=True)
class ChurnConfig:
    num_adapters: int = 1000
    num_requests: int = 256
    prompt_len: int = 64
    new_tokens: int = 32
    zipf_exponent: float = 1.0
    max_cpu_loras: int = 64
    max_loras: int = 8
    # the engine's max_lora_rank: the adapters' own rank, as one would serve them (slots are padded to it)
    max_lora_rank: int = CHURN_RANK
    baseline_adapters: int = 8
    seed: int = 11
    num_threads: int = 2


def churn_workload(cfg: ChurnConfig, vocab_size: int, num_adapters: int) -> Workload:
    rng = np.random.default_rng(cfg.seed)
    prompts = random_prompts(rng, cfg.num_requests, cfg.prompt_len, vocab_size)
    adapters = zipf_choices(
        np.random.default_rng(cfg.seed + 1), cfg.num_requests, num_adapters, cfg.zipf_exponent, base_share=0.0
    )
    # the popular adapters would otherwise sit together at one end of the batch; mix them as traffic would
    order = np.random.default_rng(cfg.seed + 2).permutation(cfg.num_requests)
    return Workload(
        prompts=prompts, adapter_of=[adapters[i] for i in order], max_tokens=[cfg.new_tokens] * cfg.num_requests
    )


def run_churn(assets: BenchAssets, cfg: ChurnConfig, log: Callable[[str], None] = print) -> dict:
    started = time.perf_counter()
    paths = churn_adapters(cfg.num_adapters)
    log(f"  {len(paths)} churn adapters ready in {time.perf_counter() - started:.1f}s")
    results = {}
    for name, count, capacity in (
        ("baseline_8_adapters", cfg.baseline_adapters, max(cfg.baseline_adapters, cfg.max_loras)),
        ("churn", cfg.num_adapters, max(cfg.max_cpu_loras, cfg.max_loras)),
    ):
        engine = OfflineEngine(
            assets.model_dir,
            paths[:count],
            num_threads=cfg.num_threads,
            max_loras=cfg.max_loras,
            max_lora_rank=cfg.max_lora_rank,
            max_cpu_loras=capacity,
            name_prefix="churn-",
        )
        try:
            register_seconds = engine.register_all()
            warm = churn_workload(replace(cfg, seed=cfg.seed + 100, num_requests=32), assets.vocab_size, count)
            engine.generate(warm)
            workload = churn_workload(cfg, assets.vocab_size, count)
            run = engine.generate(workload)
        finally:
            engine.close()
        results[name] = _summarise_run(run, workload, register_seconds, cfg)
        log(
            f"  {name}: {run.seconds:.1f}s, {run.tokens_per_second:.1f} tok/s, max queue wait {results[name]['queue_wait']['max']:.2f}s"
        )
    churn, base = results["churn"], results["baseline_8_adapters"]
    ratio = churn["tokens_per_second"] / base["tokens_per_second"]
    cpu_ratio = base["cpu_seconds"] / churn["cpu_seconds"]  # same token count in both runs
    return {
        "config": cfg.__dict__,
        **results,
        "ratios": {
            "churn offline-batch throughput / 8-adapter": {
                "value": ratio,
                "target": 0.7,
                "op": ">=",
                "met": ratio >= 0.7,
                "cpu_time_value": cpu_ratio,
            }
        },
    }


def _summarise_run(run: OfflineRun, run_workload: Workload, register_seconds: float, cfg: ChurnConfig) -> dict:
    waits, finished = [], 0
    for out in run.outputs:
        m = out.metrics
        finished += out.finished and out.outputs[0].finish_reason == "length"
        if m is not None and m.scheduled_ts:
            waits.append(m.scheduled_ts - m.arrival_time)
    return {
        "steps_lower_bound": slot_steps_bound(run_workload, cfg.max_loras),
        "register_all_seconds": register_seconds,
        "seconds": run.seconds,
        "cpu_seconds": run.cpu_seconds,
        "generated_tokens": run.tokens,
        "tokens_per_second": run.tokens_per_second,
        "requests_completed": finished,
        "requests": len(run.outputs),
        "distinct_adapters": len({o.lora_request.lora_int_id for o in run.outputs if o.lora_request is not None}),
        "queue_wait": {**percentiles(waits), "max": max(waits) if waits else float("nan")},
        "engine": run.engine,
    }


@dataclass(frozen=True)
class ChurnServingConfig:
    # the serving scenario's traffic (arrivals, prompts, lengths, rate, threads), without base-model requests
    traffic: ServingConfig = field(default_factory=lambda: ServingConfig(base_share=0.0))
    num_adapters: int = 1000
    max_cpu_loras: int = 64
    max_loras: int = 8
    max_lora_rank: int = CHURN_RANK
    baseline_adapters: int = 8


def churn_serving_config(rate: float | None, threads: int) -> ChurnServingConfig:
    """The churn-serving scenario (no base-model requests) at `rate` (None: calibrated) on `threads`."""
    default = ChurnServingConfig()
    return replace(default, traffic=replace(default.traffic, rate=rate, num_threads=threads))


def around_each_run(start: Callable[[], None], end: Callable[[], None]) -> None:
    """Call start() before and end() after each measured run of run_churn_serving in this process
    (the capacity probes before them are not included): how the bench tools attribute timings to a run."""

    def make(stream):
        async def measured(engine, loras, workload):
            start()
            result = await stream(engine, loras, workload)
            end()
            return result

        return measured

    wrap("bench.churn", "stream_workload", make)


def run_churn_serving(assets: BenchAssets, cfg: ChurnServingConfig, log: Callable[[str], None] = print) -> dict:
    """The serving traffic over 8 adapters, then the same traffic over all `num_adapters`, at one arrival rate."""
    return anyio.run(_churn_serving, assets, cfg, log)


async def _churn_serving(assets: BenchAssets, cfg: ChurnServingConfig, log) -> dict:
    from loraledger import AsyncEngine, EngineArgs, LoRARequest

    paths = churn_adapters(cfg.num_adapters)
    results: dict = {}
    traffic_cfg = cfg.traffic
    rate = traffic_cfg.rate
    workload = None
    for name, count, capacity in (
        ("baseline_8_adapters", cfg.baseline_adapters, max(cfg.baseline_adapters, cfg.max_loras)),
        ("churn", cfg.num_adapters, max(cfg.max_cpu_loras, cfg.max_loras)),
    ):
        args = EngineArgs(
            model=str(assets.model_dir),
            enable_lora=True,
            max_loras=cfg.max_loras,
            max_lora_rank=cfg.max_lora_rank,
            max_cpu_loras=capacity,
            audit_url=None,
            num_threads=traffic_cfg.num_threads,
        )
        loras = [LoRARequest(f"churn-{i}", i + 1, str(p)) for i, p in enumerate(paths[:count])]
        async with AsyncEngine.from_engine_args(args) as engine:
            started = time.perf_counter()
            for lora in loras:
                await engine.add_lora(lora)
            register_seconds = time.perf_counter() - started
            capacity_tps = await measure_capacity(engine, loras, traffic_cfg.prompt_len, assets.vocab_size)
            if rate is None:
                rate = arrival_rate(traffic_cfg, capacity_tps)  # the baseline runs first: its capacity sets the rate
            workload = churn_serving_traffic(traffic_cfg, assets.vocab_size, rate, count)
            result = await stream_workload(engine, loras, workload)
        result.update(
            register_all_seconds=register_seconds,
            capacity_tokens_per_second=capacity_tps,
            distinct_adapters=len(set(workload.adapter_of)),
            steps_lower_bound=slot_steps_bound(workload, cfg.max_loras),
        )
        results[name] = result
        log(
            f"  {name}: {result['seconds']:.1f}s, {result['tokens_per_second']:.1f} tok/s, {result['distinct_adapters']} adapters, "
            f"{result['engine']['steps']:.0f} steps (at least {result['steps_lower_bound']}), "
            f"TTFT p99 {result['ttft']['p99']:.2f}s, max queue wait {result['queue_wait']['max']:.2f}s, "
            f"{result['requests_completed']}/{result['requests']} done"
        )
    churn, base = results["churn"], results["baseline_8_adapters"]
    ratio = churn["tokens_per_second"] / base["tokens_per_second"]
    return {
        "config": {**cfg.__dict__, "traffic": traffic_cfg.__dict__, "rate_used": rate},
        "workload": {
            "requests": len(workload),
            "useful_tokens": workload.generated_tokens,
            "arrival_span_seconds": workload.arrivals[-1],
        },
        **results,
        "ratios": {
            "churn serving throughput / 8-adapter serving": {
                "value": ratio,
                "target": 0.7,
                "op": ">=",
                "met": ratio >= 0.7,
            },
        },
    }


def churn_serving_traffic(traffic_cfg: ServingConfig, vocab_size: int, rate: float, num_adapters: int) -> Workload:
    """The serving traffic at `rate` with its adapters drawn Zipf-like over `num_adapters`: the same
    arrivals, prompts and lengths for every `num_adapters`, so that only the adapters differ between runs."""
    traffic = serving_traffic(traffic_cfg, vocab_size, rate, num_adapters=1, base_share=traffic_cfg.base_share)
    adapters = zipf_choices(
        np.random.default_rng(traffic_cfg.seed + 1),
        len(traffic),
        num_adapters,
        traffic_cfg.zipf_exponent,
        traffic_cfg.base_share,
    )
    return replace(traffic, adapter_of=adapters)
