"""F.linear against Dense's oneDNN pre-packed weights on the benchmark model's projections: `python -m bench.run --only dense`.

For each projection shape of the bench model (fused qkv, o, fused gate/up, down, lm_head) and each
row count (decode batches to a prefill chunk), both forms run interleaved, `--repeats` rounds of
`--iters` calls each; the table gives the best round's milliseconds per call and the speed-up
F.linear / Dense. Outputs are compared too (max abs difference against fp64).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.bench_assets import MODEL_SHAPE
from loraledger.gpu.dense import Dense, prepack_supported


def _shapes() -> dict[str, tuple[int, int]]:
    h, i, v = MODEL_SHAPE["hidden_size"], MODEL_SHAPE["intermediate_size"], MODEL_SHAPE["vocab_size"]
    hd = h // MODEL_SHAPE["num_heads"]
    kv = MODEL_SHAPE["num_kv_heads"] * hd
    return {"qkv": (h + 2 * kv, h), "o": (h, h), "gate_up": (2 * i, h), "down": (h, i), "lm_head": (v, h)}


def _ms_per_call(fn, iters: int) -> float:
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - started) / iters * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run --only dense", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[1, 4, 32, 64, 256, 2048], help="row counts (default 1 4 32 64 256 2048)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--iters", type=int, default=10, help="calls per round (default 10)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table as JSON")
    args = parser.parse_args(argv)
    if not prepack_supported("cpu", torch.float32):
        raise SystemExit("this torch build has no oneDNN linear: Dense falls back to F.linear, nothing to compare")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    print(f"{'projection':<10} {'rows':>5} {'F.linear ms':>12} {'Dense ms':>10} {'speed-up':>9} {'max err':>9}")
    with torch.inference_mode():
        for name, (out_f, in_f) in _shapes().items():
            weight = torch.randn(out_f, in_f, generator=gen) * in_f**-0.5
            dense = Dense(weight, prepack=True)
            for rows in args.rows:
                x = torch.randn(rows, in_f, generator=gen)
                iters = max(1, args.iters if rows * out_f < 8_000_000 else args.iters // 5)
                plain, packed = [], []
                for _ in range(args.repeats):
                    plain.append(_ms_per_call(lambda: F.linear(x, weight), iters))
                    packed.append(_ms_per_call(lambda: dense(x), iters))
                ref = F.linear(x.double(), weight.double())
                err = float((dense(x).double() - ref).abs().max())
                row = {
                    "projection": name,
                    "rows": rows,
                    "f_linear_ms": min(plain),
                    "dense_ms": min(packed),
                    "max_abs_err": err,
                }
                row["speedup"] = row["f_linear_ms"] / row["dense_ms"]
                rows_out.append(row)
                print(
                    f"{name:<10} {rows:>5} {row['f_linear_ms']:>12.3f} {row['dense_ms']:>10.3f} {row['speedup']:>8.2f}x {err:>9.1e}"
                )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"threads": args.threads, "rows": rows_out}, indent=2))
        print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
