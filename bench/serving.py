"""Serving scenario: Poisson arrivals, mixed output lengths and Zipf adapters; loraledger streaming vs HF static batches.

loraledger: an AsyncEngine; each request is submitted at its arrival time and streamed (DELTA
outputs). TTFT = the engine's first_token_ts - arrival_time (RequestStateStats); ITL = gaps between
the moments the client receives tokens (a chunk carrying n tokens counts as n gaps of a 1/n share).

HF: static batches of `hf_batch` requests in arrival order. A batch starts once its last request
has arrived and the previous batch has finished, and generates to its longest request's length.
The timeline is simulated around real generate() calls: the calls run back to back and their
measured durations are placed on the arrival clock (no sleeping while "waiting" for arrivals).
A TokenClock streamer times each batch-wide token step, so a request's TTFT = batch start + time
to the first token step - arrival, and its ITL = the gaps between the token steps up to its own
length. That assumes HF streams tokens as they come; a plain non-streaming generate() would make
every TTFT the batch end, so the HF TTFT figures here are the favourable (lower) bound.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from bench.bench_assets import BenchAssets
from bench.hf_baseline import HFModel, TokenClock
from bench.stats import percentiles, stats_delta
from bench.workload import Workload, batch_workload, serving_workload
from loraledger.engine_client import EngineClient


@dataclass(frozen=True)
class ServingConfig:
    num_requests: int = 256
    rate: float | None = None  # requests/s; None: `saturation` x the engine's measured capacity at batch 32
    saturation: float = 1.25
    prompt_len: int = 64
    min_tokens: int = 8
    max_tokens: int = 128
    zipf_exponent: float = 1.0
    base_share: float = 0.15
    hf_batch: int = 32
    seed: int = 7
    num_threads: int = 2


@dataclass
class RequestTrace:
    arrival: float  # seconds on the run's clock
    tokens: int = 0
    first_token: float | None = None  # engine-side, seconds on the run's clock
    finished: float | None = None
    itl: list[float] | None = None
    queue_wait: float = 0.0  # engine-side: first scheduled - arrival
    completed: bool = False  # finished with reason "length" (all its tokens)


def run_serving(assets: BenchAssets, cfg: ServingConfig, log: Callable[[str], None] = print) -> dict:
    ll_result, rate, calibration = anyio.run(_serve_loraledger, assets, cfg, log)
    workload = ll_result.pop("workload")
    hf_result = _serve_hf(assets, cfg, workload, log)
    out = {
        "config": {**cfg.__dict__, "rate_used": rate, "calibration_tokens_per_second": calibration},
        "workload": {
            "requests": len(workload),
            "useful_tokens": workload.generated_tokens,
            "arrival_span_seconds": workload.arrivals[-1],
            "base_requests": sum(a is None for a in workload.adapter_of),
            "requests_per_adapter": [sum(a == k for a in workload.adapter_of) for k in range(len(assets.adapters))],
        },
        "loraledger": ll_result,
        "hf_static": hf_result,
    }
    ll_tps, hf_tps = ll_result["tokens_per_second"], hf_result["tokens_per_second"]
    out["ratios"] = {
        "serving throughput loraledger / HF static": {
            "value": ll_tps / hf_tps,
            "target": 2.0,
            "op": ">=",
            "met": ll_tps / hf_tps >= 2.0,
        },
        "serving p99 TTFT loraledger / HF static": {
            "value": ll_result["ttft"]["p99"] / hf_result["ttft"]["p99"],
            "target": 1.0,
            "op": "<",
            "met": ll_result["ttft"]["p99"] < hf_result["ttft"]["p99"],
        },
    }
    return out


def serving_traffic(cfg, vocab_size: int, rate: float, *, num_adapters: int, base_share: float) -> Workload:
    """The scenario's requests from a config with its fields (seed, num_requests, prompt_len, min_tokens,
    max_tokens, zipf_exponent): Poisson arrivals at `rate`, lengths, prompts and Zipf adapter bindings."""
    return serving_workload(
        cfg.seed,
        num_requests=cfg.num_requests,
        rate=rate,
        prompt_len=cfg.prompt_len,
        min_tokens=cfg.min_tokens,
        max_tokens=cfg.max_tokens,
        vocab_size=vocab_size,
        num_adapters=num_adapters,
        zipf_exponent=cfg.zipf_exponent,
        base_share=base_share,
    )


async def _serve_loraledger(assets: BenchAssets, cfg: ServingConfig, log) -> tuple[dict, float, float]:
    from loraledger import AsyncEngine, EngineArgs, LoRARequest

    args = EngineArgs(
        model=str(assets.model_dir),
        enable_lora=True,
        max_loras=8,
        max_lora_rank=16,
        audit_url=None,
        num_threads=cfg.num_threads,
    )
    loras = [LoRARequest(f"bench-{i}", i + 1, str(p)) for i, p in enumerate(assets.adapters)]
    async with AsyncEngine.from_engine_args(args) as engine:
        # warm-up, doubling as the capacity measurement the default arrival rate is derived from
        calibration = await measure_capacity(engine, loras, cfg.prompt_len, assets.vocab_size)
        rate = cfg.rate if cfg.rate is not None else arrival_rate(cfg, calibration)
        workload = serving_traffic(
            cfg, assets.vocab_size, rate, num_adapters=len(assets.adapters), base_share=cfg.base_share
        )
        log(
            f"  loraledger capacity at batch 32: {calibration:.1f} tok/s -> arrival rate {rate:.2f} req/s over {workload.arrivals[-1]:.1f}s"
        )
        result = await stream_workload(engine, loras, workload)
    log(
        f"  loraledger: {result['seconds']:.1f}s, {result['tokens_per_second']:.1f} tok/s, "
        f"TTFT p50/p99 {result['ttft']['p50']:.3f}/{result['ttft']['p99']:.3f}s"
    )
    return {**result, "workload": workload}, rate, calibration


def arrival_rate(cfg, calibration: float) -> float:
    """`cfg.saturation` times the measured capacity, in requests/s of the mean output length."""
    return cfg.saturation * calibration / ((cfg.min_tokens + cfg.max_tokens) / 2)


def _stream_params(n: int):
    from loraledger import RequestOutputKind, SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


async def measure_capacity(engine: EngineClient, loras: list, prompt_len: int, vocab_size: int) -> float:
    """Generated tokens/s for 32 prompts x 32 tokens over `loras` round-robin (twice; the first call warms up)."""
    warm = batch_workload(
        10_001, num_prompts=32, prompt_len=prompt_len, max_tokens=32, vocab_size=vocab_size, num_adapters=len(loras)
    )
    calibration = 0.0
    for _ in range(2):
        started = time.perf_counter()
        await engine.generate_many(
            [
                (
                    engine.new_request_id(),
                    {"prompt_token_ids": p},
                    _stream_params(32),
                    None if a is None else loras[a],
                    None,
                )
                for p, a in zip(warm.prompts, warm.adapter_of)
            ]
        )
        calibration = warm.generated_tokens / (time.perf_counter() - started)
    return calibration


async def stream_workload(engine: EngineClient, loras: list, workload: Workload) -> dict:
    """Submit each request at its arrival time, stream its tokens, and summarise throughput and latencies.

    Throughput = generated tokens / (last finish - first arrival); TTFT, queue wait (first scheduled -
    arrival) and end-to-end latency come from the engine's RequestStateStats, ITL from the client side.
    """
    traces = [RequestTrace(arrival=t) for t in workload.arrivals]
    start_wall = time.time() + 0.05
    before = await engine.get_stats()

    async def one(i: int) -> None:
        trace = traces[i]
        lora = None if workload.adapter_of[i] is None else loras[workload.adapter_of[i]]
        last = None
        itl: list[float] = []
        prompt = {"prompt_token_ids": workload.prompts[i]}
        async for out in engine.generate(prompt, _stream_params(workload.max_tokens[i]), engine.new_request_id(), lora):
            now = time.time()
            n = len(out.outputs[0].token_ids)
            if n and last is not None:
                itl.extend([(now - last) / n] * n)
            if n:
                last = now
            trace.tokens += n
            if out.finished:
                m = out.metrics
                trace.first_token = m.first_token_ts - start_wall
                trace.arrival = m.arrival_time - start_wall
                trace.finished = m.finished_ts - start_wall
                trace.queue_wait = m.scheduled_ts - m.arrival_time
                trace.completed = out.outputs[0].finish_reason == "length"
        trace.itl = itl

    async with anyio.create_task_group() as tg:
        for i, at in enumerate(workload.arrivals):
            delay = start_wall + at - time.time()
            if delay > 0:
                await anyio.sleep(delay)
            tg.start_soon(one, i)
    engine_delta = stats_delta(before, await engine.get_stats())
    span = max(t.finished for t in traces) - min(t.arrival for t in traces)
    tokens = sum(t.tokens for t in traces)
    ttft = [t.first_token - t.arrival for t in traces]
    itl = [g for t in traces for g in t.itl]
    waits = [t.queue_wait for t in traces]
    return {
        "seconds": span,
        "generated_tokens": tokens,
        "tokens_per_second": tokens / span,
        "requests": len(traces),
        "requests_completed": sum(t.completed for t in traces),
        "ttft": {**percentiles(ttft), "max": max(ttft)},
        "itl": {**percentiles(itl), "max": max(itl)},
        "queue_wait": {**percentiles(waits), "max": max(waits)},
        "e2e_latency": percentiles([t.finished - t.arrival for t in traces]),
        "engine_overhead_fraction": engine_delta["overhead_fraction"],
        "engine_mean_sequences_per_step": engine_delta["sequences"] / max(engine_delta["steps"], 1),
        "engine": engine_delta,
    }


def _serve_hf(assets: BenchAssets, cfg: ServingConfig, workload: Workload, log) -> dict:
    model = HFModel(assets.model_dir, assets.adapters)
    warm = batch_workload(
        10_002,
        num_prompts=cfg.hf_batch,
        prompt_len=cfg.prompt_len,
        max_tokens=8,
        vocab_size=assets.vocab_size,
        num_adapters=len(assets.adapters),
    )
    model.generate(warm.prompts, warm.adapter_of, 8)
    n = len(workload)
    ttft, itl, finish = [0.0] * n, [], [0.0] * n
    clock_now = 0.0  # the simulated time at which the previous batch finished
    wasted = 0
    for b in range(math.ceil(n / cfg.hf_batch)):
        rows = list(range(b * cfg.hf_batch, min(n, (b + 1) * cfg.hf_batch)))
        start = max(clock_now, workload.arrivals[rows[-1]])
        longest = max(workload.max_tokens[i] for i in rows)
        clock = TokenClock()
        called = time.perf_counter()
        model.generate([workload.prompts[i] for i in rows], [workload.adapter_of[i] for i in rows], longest, clock)
        duration = time.perf_counter() - called
        steps = [t - called for t in clock.times[1:]]  # token step k (0-based) came out at steps[k]
        for i in rows:
            length = workload.max_tokens[i]
            ttft[i] = start + steps[0] - workload.arrivals[i]
            itl.extend(steps[k] - steps[k - 1] for k in range(1, length))
            finish[i] = start + duration  # the batch returns as a whole
            wasted += longest - length
        clock_now = start + duration
        log(f"  HF batch {b}: start {start:6.1f}s, {len(rows)} x {longest} tokens in {duration:.1f}s")
    span = clock_now - workload.arrivals[0]
    tokens = workload.generated_tokens
    result = {
        "seconds": span,
        "generated_tokens": tokens,
        "padding_tokens_generated": wasted,
        "tokens_per_second": tokens / span,
        "ttft": {**percentiles(ttft), "max": max(ttft)},
        "itl": {**percentiles(itl), "max": max(itl)},
        "e2e_latency": percentiles([finish[i] - workload.arrivals[i] for i in range(n)]),
    }
    log(
        f"  HF static: {span:.1f}s, {tokens / span:.1f} tok/s, TTFT p50/p99 {result['ttft']['p50']:.3f}/{result['ttft']['p99']:.3f}s"
    )
    return result
