"""Kernel benchmark: CudaOps' LoRA, paged-attention and W4A16 kernels, as a share of the GPU's own copy bandwidth.

Run by hand on a GPU:  python bench/kernels.py [--sweep] [--cases lora attention w4a16] [--json out.json]

Every case is memory-bound, so each is scored by the bytes it must move (every weight, cache and
activation byte read or written once) over its median time, as a percentage of what a large
device-to-device copy achieves on the same GPU. Targets (H100): LoRA shrink+expand at
decode >= 70 %, prefill SGMV with mixed ranks >= 60 %, paged attention decode >= 70 % at
32 x 2,048 and >= 60 % at 128 x 512 and 8 x 8,192; the W4A16 decode GEMV >= 70 % on its packed bytes
(the `w4a16` cases, bench/kernels_quant.py).

Timing: the GPU time of a call is taken from CUDA-graph replays (CALLS_PER_GRAPH calls captured in
one graph, CUDA events around each replay, median over the replays, divided by the calls), as the
engine's decode steps run them; a call timed alone from Python would measure the host's launch
cost instead, and is shown beside it as "host us" (CUDA events around single calls made from
Python, median of many). The inputs of a case fill many times the L2 cache, except the small
LoRA cases, whose weights (~17 MB) would stay in the 50 MB L2 across calls: those rotate over
enough copies of their weights that every call reads them from memory.

--sweep also times the paged-attention kernel with other tokens-per-lane (U) and split lengths,
and prints which setting was fastest for each shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from bench.kernels_quant import bench_quant
from loraledger.gpu.backend import cuda_problem

CALLS_PER_GRAPH = 20
L2_ROTATE_BYTES = 512 << 20  # rotate a case's inputs until this much is touched per round: far past L2


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


def graph_ms(fn: Callable[[int], object], replays: int, variants: int = 1) -> float:
    """Median GPU milliseconds per call of `fn(i)`, from replays of a graph of CALLS_PER_GRAPH calls
    that cycle over i = 0 .. variants - 1 (each variant its own inputs, so that L2 cannot keep them)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(i % variants)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            fn(i % variants)
    return median_ms(graph.replay, 3, replays) / CALLS_PER_GRAPH


def _result(
    name: str,
    fn: Callable[[int], object],
    nbytes: int,
    copy_gbps: float | None,
    target: float | None,
    warmup: int,
    iters: int,
    variants: int = 1,
) -> Result:
    host = median_ms(lambda: fn(0), warmup, iters)
    ms = graph_ms(fn, max(10, iters // 4), variants)
    gbps = nbytes / (ms * 1e-3) / 1e9
    pct = None if copy_gbps is None else 100.0 * gbps / copy_gbps
    return Result(name, ms * 1e3, host * 1e3, nbytes, gbps, pct, target)


def bench_copy(warmup: int, iters: int) -> Result:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup, iters)
    return Result(
        "device-to-device copy, 1 GiB", ms * 1e3, ms * 1e3, 2 * src.numel(), 2 * src.numel() / ms / 1e6, None, None
    )


@dataclass(frozen=True)
class LoraCase:
    name: str
    tokens: int
    adapters: int
    hidden: int
    rank: int
    outs: tuple[int, ...]
    run: int = 1  # consecutive tokens per adapter (1: decode, BGMV; more: prefill runs, SGMV)
    ranks: tuple[int, ...] = ()  # mixed ranks cycled over the adapters (padded to `rank`), or all `rank`
    target: float | None = None


LORA_CASES = (
    LoraCase("LoRA decode: 64 tokens x 64 adapters, hidden 4096, r16", 64, 64, 4096, 16, (4096,), target=70.0),
    LoraCase("LoRA decode, 8B qkv: 32 tokens x 32 adapters", 32, 32, 4096, 16, (4096, 1024, 1024)),
    LoraCase("LoRA decode, 8B gate_up: 32 tokens x 32 adapters", 32, 32, 4096, 16, (14336, 14336)),
    LoraCase("LoRA decode, 8B down: 32 tokens x 32 adapters", 32, 32, 14336, 16, (4096,)),
    LoraCase("LoRA decode, 1B qkv: 32 tokens x 32 adapters", 32, 32, 2048, 16, (2048, 512, 512)),
    LoraCase(
        "SGMV prefill: 4096 tokens, 32 adapters x 128, ranks 8-64, 4096 -> 4096",
        4096,
        32,
        4096,
        64,
        (4096,),
        run=128,
        ranks=(8, 16, 32, 64),
        target=60.0,
    ),
    LoraCase("SGMV prefill: 4096 tokens, 32 adapters x 128, r16, 4096 -> 4096", 4096, 32, 4096, 16, (4096,), run=128),
)


def _lora_inputs(case: LoraCase, copies: int, gen: torch.Generator):
    dtype, dev = torch.bfloat16, "cuda"
    n = len(case.outs)
    out_total = sum(case.outs)
    x = torch.randn(case.tokens, case.hidden, generator=gen).to(dtype=dtype, device=dev)
    y = torch.randn(case.tokens, out_total, generator=gen).to(dtype=dtype, device=dev)
    stacks = []
    for _ in range(copies):
        a = (torch.randn(case.adapters, n * case.rank, case.hidden, generator=gen) * case.hidden**-0.5).to(
            dtype=dtype, device=dev
        )
        b = (torch.randn(case.adapters, out_total, case.rank, generator=gen) * 0.01).to(dtype=dtype, device=dev)
        stacks.append((a, b))
    return x, y, stacks


def bench_lora(copy_gbps: float, warmup: int, iters: int) -> list[Result]:
    """Each case with the fused one-launch kernel (decode, on GPUs with clusters) and with shrink then expand."""
    from loraledger.gpu.ops_cuda import CudaOps

    results = []
    gen = torch.Generator().manual_seed(21)
    size = 2  # bytes per bf16 element
    for case in LORA_CASES:
        n = len(case.outs)
        out_total = sum(case.outs)
        offsets = (0, *(sum(case.outs[: i + 1]) for i in range(n)))
        ranks = case.ranks or (case.rank,)
        adapter_ranks = [ranks[i % len(ranks)] for i in range(case.adapters)]
        # bytes a call must move: x read, y read and written, each used adapter's real rank rows of A and B
        used = sorted({(t // case.run) % case.adapters for t in range(case.tokens)})
        weight_elems = sum(adapter_ranks[s] * n * case.hidden + adapter_ranks[s] * out_total for s in used)
        nbytes = size * (case.tokens * case.hidden + 2 * case.tokens * out_total + weight_elems)
        weight_bytes = size * case.adapters * (n * case.rank * case.hidden + out_total * case.rank)
        copies = max(1, min(16, L2_ROTATE_BYTES // max(weight_bytes, 1)))
        x, y, stacks = _lora_inputs(case, copies, gen)
        slots = (torch.arange(case.tokens, device="cuda") // case.run % case.adapters).to(torch.int32)
        modes = ("fused", "bgmv") if case.run == 1 else ("sgmv",)
        for mode in modes:
            ops = CudaOps("cuda", lora_kernel=mode)
            if mode == "fused" and ops.compute_capability < (9, 0):
                continue
            meta = ops.lora_prepare(slots, case.adapters)
            if case.ranks:
                meta.extra.update(
                    slot_ranks=torch.tensor(adapter_ranks, dtype=torch.int32, device="cuda"), max_rank=case.rank
                )

            def call(i: int, ops=ops, meta=meta) -> None:
                a, b = stacks[i]
                ops.lora_apply(x, a, b, meta, offsets, y)

            label = {"fused": "fused kernel", "bgmv": "shrink + expand", "sgmv": "SGMV shrink + expand"}[mode]
            target = case.target if mode in ("fused", "sgmv") else None
            results.append(_result(f"{case.name} [{label}]", call, nbytes, copy_gbps, target, warmup, iters, copies))
    return results


@dataclass(frozen=True)
class AttentionCase:
    seqs: int
    context: int
    target: float
    hq: int = 32
    hk: int = 8
    d: int = 128
    block_size: int = 16

    @property
    def name(self) -> str:
        return f"paged attention decode: {self.seqs} seqs x {self.context} ctx, {self.hq}/{self.hk} heads x {self.d}, block {self.block_size}, bf16"


ATTENTION_CASES = (AttentionCase(32, 2048, 70.0), AttentionCase(128, 512, 60.0), AttentionCase(8, 8192, 60.0))


def _attention_call(case: AttentionCase, gen: torch.Generator):
    dtype = torch.bfloat16
    blocks_per_seq = case.context // case.block_size
    num_blocks = case.seqs * blocks_per_seq
    k_cache = torch.randn(num_blocks, case.block_size, case.hk, case.d, generator=gen).to(dtype=dtype, device="cuda")
    v_cache = torch.randn(num_blocks, case.block_size, case.hk, case.d, generator=gen).to(dtype=dtype, device="cuda")
    # scattered blocks, as a long-running cache has them
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(case.seqs, blocks_per_seq).cuda()
    seq_lens = torch.full((case.seqs,), case.context, dtype=torch.int32, device="cuda")
    q = torch.randn(case.seqs, case.hq, case.d, generator=gen).to(dtype=dtype, device="cuda")
    size = 2
    nbytes = size * (2 * case.seqs * case.context * case.hk * case.d + 2 * q.numel()) + 4 * (tables.numel() + case.seqs)
    return (q, k_cache, v_cache, tables, seq_lens, case.d**-0.5), nbytes


def bench_attention(copy_gbps: float, warmup: int, iters: int) -> list[Result]:
    from loraledger.gpu.ops_cuda import CudaOps

    ops = CudaOps("cuda")
    gen = torch.Generator().manual_seed(22)
    results = []
    for case in ATTENTION_CASES:
        args, nbytes = _attention_call(case, gen)
        results.append(
            _result(
                case.name,
                lambda _i, a=args: ops.paged_attention_decode(*a),
                nbytes,
                copy_gbps,
                case.target,
                warmup,
                iters,
            )
        )
        del args
    return results


def sweep_attention(
    copy_gbps: float,
    warmup: int,
    iters: int,
    us: tuple[int, ...] = (1, 2, 4),
    splits: tuple[int, ...] = (512, 1024, 2048, 4096),
) -> list[dict]:
    """Each attention case under other tokens-per-lane (U) and shortest splits, the kernel template widened to match."""
    import loraledger.gpu.ops_cuda_attention as attention
    from loraledger.gpu import kernel_sources as ks
    from loraledger.gpu.ops_cuda import CudaOps

    shipped_template, shipped_u, shipped_split = (
        ks.PAGED_ATTENTION_DECODE,
        ks.attention_tokens_per_lane,
        attention.SPLIT_MIN,
    )
    gen = torch.Generator().manual_seed(23)
    rows = []
    try:
        for u in us:
            extra = tuple((t, hp, epl, str(u)) for t, hp, epl, _ in shipped_template.instantiations)
            ks.PAGED_ATTENTION_DECODE = replace(
                shipped_template, instantiations=shipped_template.instantiations + extra
            )
            ks.attention_tokens_per_lane = lambda ctype, hp, epl, u=u: u
            for split_min in splits:
                attention.SPLIT_MIN = split_min
                ops = CudaOps("cuda")
                for case in ATTENTION_CASES:
                    args, nbytes = _attention_call(case, gen)
                    r = _result(
                        case.name,
                        lambda _i, a=args: ops.paged_attention_decode(*a),
                        nbytes,
                        copy_gbps,
                        None,
                        warmup,
                        iters,
                    )
                    rows.append(
                        {
                            "case": case.name,
                            "U": u,
                            "split_min": split_min,
                            "time_us": r.time_us,
                            "pct_of_copy": r.pct_of_copy,
                        }
                    )
                    del args
    finally:
        ks.PAGED_ATTENTION_DECODE, ks.attention_tokens_per_lane, attention.SPLIT_MIN = (
            shipped_template,
            shipped_u,
            shipped_split,
        )
    return rows


def _table(results: list[Result]) -> str:
    lines = [f"{'benchmark':<96} {'GPU us':>8} {'host us':>8} {'GB/s':>8} {'% copy':>7} {'target':>7}"]
    for r in results:
        pct = "" if r.pct_of_copy is None else f"{r.pct_of_copy:.1f}"
        target = "" if r.target_pct is None else f">={r.target_pct:.0f}"
        lines.append(f"{r.name:<96} {r.time_us:>8.1f} {r.host_us:>8.1f} {r.gbps:>8.1f} {pct:>7} {target:>7}")
    return "\n".join(lines)


def no_gpu(prog: str) -> bool:
    """True, after saying why on stderr, when the CUDA backend cannot run here (every GPU benchmark's guard)."""
    problem = cuda_problem()
    if problem is not None:
        print(f"{prog} needs a GPU: {problem}", file=sys.stderr)
    return problem is not None


CASE_GROUPS: dict[str, Callable[[float, int, int], list[Result]]] = {
    "lora": bench_lora,
    "attention": bench_attention,
    "w4a16": lambda copy_gbps, warmup, iters: bench_quant(copy_gbps, warmup, iters, _result),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument(
        "--sweep", action="store_true", help="also sweep paged attention's tokens per lane and split length"
    )
    parser.add_argument("--sweep-u", type=int, nargs="+", default=[1, 2, 4], help="tokens per lane to sweep")
    parser.add_argument(
        "--sweep-split", type=int, nargs="+", default=[512, 1024, 2048, 4096], help="shortest splits to sweep"
    )
    parser.add_argument(
        "--cases", nargs="+", choices=CASE_GROUPS, default=list(CASE_GROUPS), help="which groups of cases to run"
    )
    args = parser.parse_args(argv)
    if no_gpu("bench/kernels.py"):
        return 2
    copy = bench_copy(args.warmup, args.iters)
    results = [copy]
    for group in args.cases:
        results += CASE_GROUPS[group](copy.gbps, args.warmup, args.iters)
    device = torch.cuda.get_device_name()
    print(f"device: {device}\n{_table(results)}")
    sweep = []
    if args.sweep and "attention" in args.cases:
        sweep = sweep_attention(copy.gbps, 5, 60, tuple(args.sweep_u), tuple(args.sweep_split))
    for case in ATTENTION_CASES:
        mine = [r for r in sweep if r["case"] == case.name]
        if mine:
            print(
                f"sweep {case.seqs} x {case.context}: "
                + "  ".join(f"U{r['U']}/s{r['split_min']} {r['pct_of_copy']:.0f}%" for r in mine)
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "device": device,
                    "copy_gbps": copy.gbps,
                    "results": [asdict(r) for r in results],
                    "attention_sweep": sweep,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
