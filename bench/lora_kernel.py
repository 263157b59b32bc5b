"""The CPU LoRA kernel against the plain-torch LoRA path, side by side: `python -m bench.run --only cpu-lora-kernel`.

The question it answers: what does a batch of many adapters cost next to the same batch with none, on our own
engine, and how much of that does the kernel (gpu/lora_cpu_kernel.py) take away. The bench model (Llama-shaped,
hidden 512, 8 layers, vocab 32,000), 6 of its rank-16 adapters on all seven projections; 24 prompts of 48 ids,
40 greedy tokens; two workloads on a LoRA-enabled engine: the mixed batch (6 adapters + base rows) and the same
prompts with no adapter. Two engines per dtype in this process: one whose adapter slots hold B rank-major (the
kernel runs) and one built with the kernel switched off ($LORALEDGER_CPU_KERNELS=0 while it is
built: its slots hold B block-diagonal and every LoRA product runs in torch). Every round runs both workloads on
both engines, alternating the engine order; read the per-round ratios (median, range): own mixed / own no-adapter
for each path, and the kernel's mixed tokens/s over the torch path's. Greedy ids of the two paths are compared
(fp32: equal on every row expected; bf16: two bf16 computations drift apart on this random model).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from bench.bench_assets import model_assets
from bench.stats import median
from loraledger import LLM, LoRARequest, SamplingParams
from loraledger.gpu import cpu_features, cpu_kernels, lora_cpu_kernel

PATHS = ("kernel", "torch")


def _engine(model_dir: str, dtype: str, path: str, threads: int) -> LLM:
    """A LoRA-enabled engine whose slots are laid out for `path` (the layout decides which path runs)."""
    saved = os.environ.get(cpu_kernels.DISABLE_ENV)
    if path == "torch":
        os.environ[cpu_kernels.DISABLE_ENV] = "0"
    _forget_kernels()
    try:
        if path == "kernel" and lora_cpu_kernel.load() is None:
            raise SystemExit("the CPU LoRA kernel did not build here (see the log): nothing to compare")
        return LLM(
            model=model_dir, device="cpu", dtype=dtype, audit_url=None, num_threads=threads,
            enable_lora=True, max_loras=6, max_lora_rank=16,
        )  # fmt: skip
    finally:
        if saved is None:
            os.environ.pop(cpu_kernels.DISABLE_ENV, None)
        else:
            os.environ[cpu_kernels.DISABLE_ENV] = saved
        _forget_kernels()


def _forget_kernels() -> None:
    lora_cpu_kernel.load.cache_clear()
    cpu_kernels.library.cache_clear()


def _spread(values: list[float], unit: str = "") -> str:
    return f"{median(values):,.2f}{unit} ({min(values):,.2f}-{max(values):,.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run --only cpu-lora-kernel", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument(
        "--dtypes", nargs="+", choices=("float32", "bfloat16"), default=None,
        help="default: bfloat16 where the CPU multiplies it natively, and float32",
    )  # fmt: skip
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    dtypes = args.dtypes or (["bfloat16"] if cpu_features.native_bf16() else []) + ["float32"]

    assets = model_assets()
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(4, assets.vocab_size) for _ in range(args.prompt_len)]}
        for _ in range(args.prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(assets.adapters[:6])]
    workloads = {"mixed": [None if i % 7 == 6 else loras[i % 7] for i in range(len(prompts))], "no-adapter": None}
    report: dict = {"args": vars(args), "dtypes": {}}
    for dtype in dtypes:
        engines = {p: _engine(str(assets.model_dir), dtype, p, args.threads) for p in PATHS}
        tps: dict[tuple[str, str], list[float]] = {(p, w): [] for p in PATHS for w in workloads}
        ids: dict[str, list] = {}
        try:
            for e in engines.values():  # warm-up: first-call allocations, oneDNN primitives, adapter loads
                e.generate(prompts[:8], SamplingParams(max_tokens=4), lora_request=loras + [None, None], use_tqdm=False)
            for r in range(args.rounds):
                order = PATHS if r % 2 == 0 else PATHS[::-1]
                for workload, requests in workloads.items():
                    for path in order:
                        started = time.perf_counter()
                        outs = engines[path].generate(prompts, params, lora_request=requests, use_tqdm=False)
                        elapsed = time.perf_counter() - started
                        tps[(path, workload)].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
                        if workload == "mixed":
                            ids[path] = [list(o.outputs[0].token_ids) for o in outs]
                print(f"{dtype}: round {r + 1}/{args.rounds} done (load {os.getloadavg()[0]:.1f})", flush=True)
        finally:
            for e in engines.values():
                e.close()
        own = {p: [m / b for m, b in zip(tps[(p, "mixed")], tps[(p, "no-adapter")])] for p in PATHS}
        speedup = [k / t for k, t in zip(tps[("kernel", "mixed")], tps[("torch", "mixed")])]
        same = sum(a == b for a, b in zip(ids["kernel"], ids["torch"]))
        report["dtypes"][dtype] = {"tok_s": {f"{p} {w}": v for (p, w), v in tps.items()}, "own_ratio": own,
                                   "kernel_over_torch_mixed": speedup, "mixed_rows_equal": same}  # fmt: skip
        print(f"\n{dtype}, {args.threads} threads, {args.rounds} alternating rounds")
        print("| path | mixed tok/s | no adapter tok/s | own mixed / own no-adapter per round |")
        print("|---|---:|---:|---:|")
        for p in PATHS:
            print(
                f"| {p} | {_spread(tps[(p, 'mixed')])} | {_spread(tps[(p, 'no-adapter')])} | {_spread(own[p], 'x')} |"
            )
        print(f"kernel / torch, mixed tok/s per round: {_spread(speedup, 'x')}; mixed rows with equal greedy ids "
              f"{same}/{len(prompts)}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
