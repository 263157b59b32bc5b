"""The CPU attention kernel against the torch paths it replaces, side by side: `python -m bench.run --only cpu-attention`.

Decode: gpu/attention_cpu_kernel.decode (the paged cache read in place) against TorchOps.gathered_attention_decode
(blocks gathered, padded mask, SDPA), for a decode step of the bench model's attention (GQA 8/2 x 64, block 16) at
24 sequences of 48, 88 and 400 keys. Prefill: TorchOps.prefill_attention with the kernel (each query row over its
causal prefix, contexts up to KERNEL_PREFILL_MAX_CONTEXT) against the same call with that limit at 0 (SDPA), for
24 prompts of 16 to 96 tokens (one case the last 16 of 48 after a prefix-cache hit) and 8 of 128. Each round times
every case on both paths, alternating which goes first; the table gives each path's median microseconds per call and
the per-round ratios (torch / kernel).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.stats import median
from loraledger.gpu import attention_cpu_kernel, ops_torch
from loraledger.gpu.ops_torch import TorchOps

HQ, HK, D, BLOCK = 8, 2, 64, 16
# (prompts, query tokens, tokens already cached before them)
PREFILLS = ((24, 16, 0), (24, 32, 0), (24, 48, 0), (24, 16, 32), (24, 64, 0), (24, 96, 0), (8, 128, 0))


def _cache(batch: int, keys: int, dtype: torch.dtype, g: torch.Generator):
    per = -(-keys // BLOCK)
    blocks = batch * per
    k_cache = torch.randn(blocks, BLOCK, HK, D, generator=g).to(dtype)
    v_cache = torch.randn(blocks, BLOCK, HK, D, generator=g).to(dtype)
    order = torch.randperm(blocks, generator=g).to(torch.int32)  # scattered blocks, as a long-running cache holds them
    return k_cache, v_cache, order.reshape(batch, per)


def decode_case(batch: int, keys: int, dtype: torch.dtype, g: torch.Generator) -> dict:
    k_cache, v_cache, tables = _cache(batch, keys, dtype, g)
    q = torch.randn(batch, HQ + 2 * HK, D, generator=g).to(dtype)[:, :HQ]  # a view of a fused qkv row
    lens = torch.full((batch,), keys, dtype=torch.int32)
    ops = TorchOps()
    return {
        "kernel": lambda: attention_cpu_kernel.decode(q, k_cache, v_cache, tables, lens, D**-0.5, None, None),
        "torch": lambda: ops.gathered_attention_decode(q, k_cache, v_cache, tables, lens, D**-0.5),
    }


def prefill_case(batch: int, tokens: int, cached: int, dtype: torch.dtype, g: torch.Generator) -> dict:
    """`batch` prompts whose last `tokens` are queries after `cached` tokens already in the cache (a prefix hit).
    Each path keeps one TorchOps, as the engine does: its per-step plan is made once and serves every layer."""
    k_cache, v_cache, tables = _cache(batch, cached + tokens, dtype, g)
    q = torch.randn(batch * tokens, HQ + 2 * HK, D, generator=g).to(dtype)[:, :HQ]
    starts = torch.arange(0, batch * tokens + 1, tokens, dtype=torch.int32)
    lens = torch.full((batch,), cached + tokens, dtype=torch.int32)

    def run(ops: TorchOps, limit: int):
        saved = ops_torch.KERNEL_PREFILL_MAX_CONTEXT
        ops_torch.KERNEL_PREFILL_MAX_CONTEXT = limit
        try:
            return ops.prefill_attention(q, k_cache, v_cache, starts, lens, tables, D**-0.5)
        finally:
            ops_torch.KERNEL_PREFILL_MAX_CONTEXT = saved

    kernel_ops, torch_ops = TorchOps(), TorchOps()
    return {"kernel": lambda: run(kernel_ops, 1 << 30), "torch": lambda: run(torch_ops, 0)}


def _seconds(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    if decode_case(1, 1, torch.float32, g)["kernel"]() is None:
        raise SystemExit("the CPU attention kernel did not build here (see the log): nothing to compare")
    cases = []
    for dtype in (getattr(torch, d) for d in args.dtypes):
        name = str(dtype).removeprefix("torch.")
        for keys in (48, 88, 400):
            cases.append((f"decode, 24 seqs x {keys} keys", name, decode_case(24, keys, dtype, g), 40))
        for batch, tokens, cached in PREFILLS:
            label = f"prefill, {batch} prompts x {tokens} tokens" + (f" after {cached} cached" if cached else "")
            cases.append((label, name, prefill_case(batch, tokens, cached, dtype, g), 8))
    times: dict[tuple, dict[str, list[float]]] = {}
    with torch.inference_mode():
        for _, _, paths, _ in cases:
            for fn in paths.values():
                fn()  # first calls: the kernel's build and load, workspaces
        for r in range(args.rounds):
            for label, dtype, paths, calls in cases:
                for path in ("kernel", "torch") if r % 2 == 0 else ("torch", "kernel"):
                    times.setdefault((label, dtype), {}).setdefault(path, []).append(_seconds(paths[path], calls))
    print("| case | dtype | kernel us | torch path us | torch / kernel per round (median, range) |")
    print("|---|---|---:|---:|---:|")
    for (label, dtype), t in times.items():
        ratios = [a / b for a, b in zip(t["torch"], t["kernel"])]
        print(
            f"| {label} | {dtype} | {median(t['kernel']) * 1e6:,.0f} | {median(t['torch']) * 1e6:,.0f} | "
            f"{median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
