"""Kernel benchmark: CudaOps' LoRA and paged-attention kernels, as a share of the GPU's own copy bandwidth.

Run by hand on a GPU:  python bench/kernels.py --json out.json

Both ops are memory-bound, so each is scored by the bytes it must move (every weight, cache and
activation byte read or written once) over its median time, as a percentage of what a large
device-to-device copy achieves on the same GPU. Targets: LoRA shrink+expand >= 70 %, paged
attention decode >= 60 %.

Timing: the GPU time of a call is taken from CUDA-graph replays (CALLS_PER_GRAPH calls captured in
one graph, CUDA events around each replay, median over the replays, divided by the calls), as the
engine's decode steps run them; a call timed alone from Python would measure the host's launch
cost instead (on an H100 that is most of the time for these microsecond kernels), and is shown
beside it as "host us": CUDA events around single calls made from Python, median of many.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from loraledger.gpu.backend import cuda_problem


CALLS_PER_GRAPH = 20


@dataclass
class Result:
    name: str
    time_us: float
    host_us: float
    bytes_moved: int
    gbps: float
    pct_of_copy: float | None
    target_pct: float | None


def median_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def graph_ms(fn: Callable[[], object], replays: int) -> float:
    """Median GPU milliseconds per call of `fn`, from replays of a graph of CALLS_PER_GRAPH calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    return median_ms(graph.replay, 3, replays) / CALLS_PER_GRAPH


def _result(
    name: str, fn: Callable[[], object], nbytes: int, copy_gbps: float | None, target: float | None, warmup: int, iters: int
) -> Result:
    host = median_ms(fn, warmup, iters)
    ms = graph_ms(fn, max(10, iters // 4))
    gbps = nbytes / (ms * 1e-3) / 1e9
    pct = None if copy_gbps is None else 100.0 * gbps / copy_gbps
    return Result(name, ms * 1e3, host * 1e3, nbytes, gbps, pct, target)


def bench_copy(warmup: int, iters: int) -> Result:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup, iters)
    return Result("device-to-device copy, 1 GiB", ms * 1e3, ms * 1e3, 2 * src.numel(), 2 * src.numel() / ms / 1e6, None, None)


def bench_lora(ops, copy_gbps: float, warmup: int, iters: int) -> list[Result]:
    """64 decode tokens, each with its own adapter (64 slots), hidden 4096, rank 16, bf16, one q_proj-like slice."""
    tokens, hidden, rank, dtype = 64, 4096, 16, torch.bfloat16
    x = torch.randn(tokens, hidden, dtype=dtype, device="cuda")
    a = torch.randn(tokens, rank, hidden, dtype=dtype, device="cuda") * hidden**-0.5
    b = torch.randn(tokens, hidden, rank, dtype=dtype, device="cuda") * 0.01
    y = torch.randn(tokens, hidden, dtype=dtype, device="cuda")
    meta = ops.lora_prepare(torch.arange(tokens, dtype=torch.int32, device="cuda"), tokens)
    h = ops.lora_shrink(x, a, meta)
    offsets = (0, hidden)
    size = 2  # bytes per bf16 element
    shrink_bytes = size * (x.numel() + a.numel() + h.numel())
    expand_bytes = size * (h.numel() + b.numel() + 2 * y.numel())  # y is read and written

    def both() -> None:
        ops.lora_expand(ops.lora_shrink(x, a, meta), b, meta, offsets, y)

    return [
        _result(
            "LoRA shrink+expand: 64 tokens x 64 adapters, hidden 4096, rank 16, bf16",
            both, shrink_bytes + expand_bytes, copy_gbps, 70.0, warmup, iters,
        ),
        _result("  shrink alone", lambda: ops.lora_shrink(x, a, meta), shrink_bytes, copy_gbps, None, warmup, iters),
        _result(
            "  expand alone", lambda: ops.lora_expand(h, b, meta, offsets, y), expand_bytes, copy_gbps, None, warmup, iters
        ),
    ]


def bench_decode(ops, copy_gbps: float, warmup: int, iters: int) -> Result:
    """32 sequences x 2048 context, Llama-3-8B attention shape (32 query / 8 KV heads, head 128), block 16, bf16."""
    seqs, context, hq, hk, d, block_size, dtype = 32, 2048, 32, 8, 128, 16, torch.bfloat16
    blocks_per_seq = context // block_size
    num_blocks = seqs * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, hk, d, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    # scattered blocks, as a long-running cache has them
    tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(seqs, blocks_per_seq)
    seq_lens = torch.full((seqs,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(seqs, hq, d, dtype=dtype, device="cuda")
    size = 2
    nbytes = size * (2 * seqs * context * hk * d + 2 * q.numel()) + 4 * (tables.numel() + seqs)

    def run() -> None:
        ops.paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, d**-0.5)

    name = "paged attention decode: 32 seqs x 2048 ctx, 32/8 heads x 128, block 16, bf16"
    return _result(name, run, nbytes, copy_gbps, 60.0, warmup, iters)


def _table(results: list[Result]) -> str:
    lines = [f"{'benchmark':<76} {'GPU us':>8} {'host us':>8} {'GB/s':>8} {'% copy':>7} {'target':>7}"]
    for r in results:
        pct = "" if r.pct_of_copy is None else f"{r.pct_of_copy:.1f}"
        target = "" if r.target_pct is None else f">={r.target_pct:.0f}"
        lines.append(f"{r.name:<76} {r.time_us:>8.1f} {r.host_us:>8.1f} {r.gbps:>8.1f} {pct:>7} {target:>7}")
    return "\n".join(lines)


def no_gpu(prog: str) -> bool:
    """True, after saying why on stderr, when the CUDA backend cannot run here (every GPU benchmark's guard)."""
    problem = cuda_problem()
    if problem is not None:
        print(f"{prog} needs a GPU: {problem}", file=sys.stderr)
    return problem is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args(argv)
    if no_gpu("bench/kernels.py"):
        return 2
    from loraledger.gpu.ops_cuda import CudaOps

    ops = CudaOps("cuda")
    copy = bench_copy(args.warmup, args.iters)
    lora = bench_lora(ops, copy.gbps, args.warmup, args.iters)
    results = [copy, *lora, bench_decode(ops, copy.gbps, args.warmup, args.iters)]
    device = torch.cuda.get_device_name()
    print(f"device: {device}\n{_table(results)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": device, "copy_gbps": copy.gbps, "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
