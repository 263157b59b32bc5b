"""TorchOps' decode attention and rotary against the formulations they replaced: `python -m bench.cpu_ops`.

At the bench model's shapes (8 query / 2 KV heads of 64, hidden 512) and small-step sizes (13
and 45 sequences or tokens, contexts of 70-192 positions), each pair runs interleaved in rounds and
the median of the rounds is printed with the speed-up and the largest difference:
- decode attention: query heads grouped per KV head ([B, Hk, Hq/Hk, D]) against SDPA over the
  query heads with `enable_gqa` (K and V expanded per query head);
- rotary: q and k rotated as one view of the fused qkv output against one pass each.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from loraledger.gpu.ops_torch import TorchOps

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 64, 16


def _decode_expanded(ops: TorchOps, q, k_cache, v_cache, tables, lens, scale):
    block_size = k_cache.shape[1]
    flat, used = ops._context_blocks(tables, lens, block_size, "expanded")
    keys, values = ops._gather_blocks(k_cache, v_cache, flat, used, tables.shape[0])
    key_pos = torch.arange(used * block_size)
    allowed = key_pos[None, :] < lens.to(torch.int64)[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=allowed[:, None, None, :], scale=scale, enable_gqa=True)
    return out[:, :, 0, :]


def _rotary_per_tensor(positions, q, k, cache):
    half = cache.shape[-1] // 2
    cs = cache.index_select(0, positions)
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half], x[..., half:]
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        x[..., :half].copy_(o1)
        x[..., half:].copy_(o2)


def _time(fn: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def compare(name: str, new: Callable[[], object], old: Callable[[], object], rounds: int, calls: int) -> None:
    out_new, out_old = new(), old()
    diff = f"{float((out_new - out_old).abs().max()):.1e}" if isinstance(out_new, torch.Tensor) else "-"
    times: dict[str, list[float]] = {"new": [], "old": []}
    for _ in range(rounds):
        times["new"].append(_time(new, calls))
        times["old"].append(_time(old, calls))
    n, o = statistics.median(times["new"]), statistics.median(times["old"])
    print(f"  {name:<34} {n:8.1f} us  (was {o:8.1f} us)  {o / n:5.2f}x  max diff {diff}")


def _compare_at(n: int, ops: TorchOps, g: torch.Generator, rounds: int, calls: int) -> None:
    # decode attention over a paged cache: n sequences of 70..192 positions
    blocks = 4096
    k_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    v_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    lens = torch.randint(70, 193, (n,), generator=g, dtype=torch.int32)
    tables = torch.randperm(blocks, generator=g)[: n * 12].view(n, 12).to(torch.int32)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g)
    compare(
        f"decode attention, {n} seqs",
        lambda: ops.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.125),
        lambda: _decode_expanded(ops, q, k_cache, v_cache, tables, lens, 0.125),
        rounds,
        calls,
    )
    # rotary on the q and k blocks of a fused qkv output (rotating in place: the values drift, the timing does not)
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g)
    qv = qkv[:, : HEADS * HEAD_DIM].view(n, HEADS, HEAD_DIM)
    kv = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(n, KV_HEADS, HEAD_DIM)
    cache = torch.randn(1024, HEAD_DIM, generator=g)
    positions = torch.randint(0, 1024, (n,), generator=g)
    compare(
        f"rotary, {n} tokens",
        lambda: ops.rotary_embedding(positions, qv, kv, cache),
        lambda: _rotary_per_tensor(positions, qv, kv, cache),
        rounds,
        calls,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_ops", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    ops = TorchOps()
    print(f"TorchOps decode attention and rotary, {args.threads} threads, median of {args.rounds} rounds of {args.calls} calls")
    for n in (13, 45):
        _compare_at(n, ops, g, args.rounds, args.calls)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
