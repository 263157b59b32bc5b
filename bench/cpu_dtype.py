"""Our CPU path in float32 against bfloat16, side by side: `python -m bench.run --only cpu-dtype`.

The bench model (Llama-shaped, hidden 512, 8 layers, vocab 32,000) and its rank-16 adapters; 24 prompts of 48
ids, 40 greedy tokens; three workloads: LoRA disabled (base model), LoRA enabled with no adapter in the batch,
and a mixed batch (6 adapters + base rows). One engine per (dtype, LoRA on/off) stays open; every round runs
every engine once, alternating the dtype order, so a busy machine slows both sides alike: read the bf16/fp32
ratios (median and range over rounds), not the absolute tokens/s. Greedy ids of the two dtypes are compared too
(the share of rows whose ids agree all the way).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from bench.bench_assets import model_assets
from bench.stats import median
from loraledger import LLM, LoRARequest, SamplingParams

DTYPES = ("float32", "bfloat16")
WORKLOADS = ("lora-disabled", "lora-enabled-no-adapter", "mixed-6-adapters")


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(n)]


def _engine(model_dir: str, dtype: str, lora: bool, threads: int | None) -> LLM:
    extra = {"enable_lora": True, "max_loras": 6, "max_lora_rank": 16} if lora else {}
    return LLM(model=model_dir, device="cpu", dtype=dtype, audit_url=None, num_threads=threads, **extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run --only cpu-dtype", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--prompts", type=int, default=24, help="prompts per batch (default 24)")
    parser.add_argument("--prompt-len", type=int, default=48, help="ids per prompt (default 48)")
    parser.add_argument("--tokens", type=int, default=40, help="greedy tokens per prompt (default 40)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)

    assets = model_assets()
    model_dir = str(assets.model_dir)
    prompts = [{"prompt_token_ids": p} for p in _prompts(args.prompts, args.prompt_len, assets.vocab_size)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(assets.adapters[:6])]
    mixed = [None if i % 7 == 6 else loras[i % 7] for i in range(len(prompts))]  # 6 adapters + base rows
    engines = {(d, lora): _engine(model_dir, d, lora, args.threads) for d in DTYPES for lora in (False, True)}
    runs = {
        "lora-disabled": (False, None),
        "lora-enabled-no-adapter": (True, None),
        "mixed-6-adapters": (True, mixed),
    }
    tps: dict[tuple[str, str], list[float]] = {(w, d): [] for w in WORKLOADS for d in DTYPES}
    ids: dict[tuple[str, str], list[list[int]]] = {}
    try:
        for e in engines.values():  # warm-up: first-call allocations and oneDNN primitive creation
            e.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        for r in range(args.rounds):
            order = DTYPES if r % 2 == 0 else DTYPES[::-1]
            for workload, (lora, requests) in runs.items():
                for dtype in order:
                    started = time.perf_counter()
                    outs = engines[(dtype, lora)].generate(prompts, params, lora_request=requests)
                    elapsed = time.perf_counter() - started
                    tps[(workload, dtype)].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
                    ids[(workload, dtype)] = [o.outputs[0].token_ids for o in outs]
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        for e in engines.values():
            e.close()
    report = {"args": vars(args), "workloads": {}}
    print(
        "| workload | fp32 tok/s (median, range) | bf16 tok/s (median, range) | bf16/fp32 per round (median, range) "
        "| rows with equal ids |"
    )
    print("|---|---:|---:|---:|---:|")
    for w in WORKLOADS:
        f, b = tps[(w, "float32")], tps[(w, "bfloat16")]
        ratios = [y / x for x, y in zip(f, b)]
        same = sum(a == c for a, c in zip(ids[(w, "float32")], ids[(w, "bfloat16")]))
        report["workloads"][w] = {"float32": f, "bfloat16": b, "ratios": ratios, "rows_equal": same}
        print(
            f"| {w} | {median(f):,.0f} ({min(f):,.0f}-{max(f):,.0f}) | {median(b):,.0f} ({min(b):,.0f}-{max(b):,.0f}) "
            f"| {median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | {same}/{len(prompts)} |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
