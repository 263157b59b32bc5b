"""Weight-only quantized projections on the CPU vs dense ones: `python -m bench.run --only quant-linear`.

For each shape (out, in) and row count, six forms of one random weight run interleaved, `--repeats` rounds of
`--iters` calls each: fp32 dense and bf16 dense (F.linear), 4-bit (group `--group`, default 128) on torch's int4 CPU
kernel at every row count, the same packed weight dequantized per call into a scratch bf16 weight then one dense
product (int4pack_dense, what a layer runs from LARGE_STEP_ROWS rows), 8-bit per-channel on torch's int8 CPU
kernel, and the dequantize-once fallback (a bf16 dense weight built at load). The table gives the best round's
milliseconds per call, each form's speed-up over fp32 dense, and resident bytes of the weight relative to bf16.
`--shapes 768x512 2688x512 512x1344 --group 64 --rows 16 32 64 96 128 256` sweeps the bench model's projections.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from loraledger.quantization import QuantizedLinear
from loraledger.quantization.packing import compressed_tensors_pack, compressed_tensors_unpack


def _layer(w: torch.Tensor, bits: int, group: int | None, allow_kernel: bool = True) -> QuantizedLinear:
    t = compressed_tensors_pack(w, bits, group, True)
    q, scale, zero = compressed_tensors_unpack(t["weight_packed"], t["weight_scale"], None, bits, w.shape[1])
    return QuantizedLinear(q, scale, zero, bits, allow_kernel=allow_kernel)


def _ms(fn, iters: int) -> float:
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - started) / iters * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run --only quant-linear", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--shapes", nargs="+", default=["2048x2048", "5632x2048"], help="OUTxIN (default 2048x2048 5632x2048)"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32], help="row counts (default 1 8 32)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds, best one kept (default 5)")
    parser.add_argument("--iters", type=int, default=20, help="calls per round (default 20)")
    parser.add_argument("--group", type=int, default=128, help="4-bit group size (default 128)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        "shape       rows  fp32 ms  bf16 ms  int4 ms  int4-dense ms  int8 ms  deq ms | x fp32: bf16  int4  int4-dense  int8  deq"
    )
    for shape in args.shapes:
        out, k = map(int, shape.split("x"))
        w = torch.randn(out, k) * 0.02
        w16 = w.to(torch.bfloat16)
        int4, int8, deq = _layer(w, 4, args.group), _layer(w, 8, None), _layer(w, 4, args.group, allow_kernel=False)
        int4_dense = _layer(w, 4, args.group)
        assert (int4.path, int8.path, deq.path) == ("int4pack", "int8pack", "dequantized")
        int4.large_step_rows, int4_dense.large_step_rows = 1 << 30, 0  # each form at every row count
        for rows in args.rows:
            x = torch.randn(rows, k)
            xb = x.to(torch.bfloat16)
            forms = {
                "fp32": lambda: F.linear(x, w),
                "bf16": lambda: F.linear(xb, w16),
                "int4": lambda: int4(xb),
                "int4-dense": lambda: int4_dense(xb),
                "int8": lambda: int8(xb),
                "deq": lambda: deq(xb),
            }
            best = {name: float("inf") for name in forms}
            for _ in range(args.repeats):
                for name, fn in forms.items():
                    fn()
                    best[name] = min(best[name], _ms(fn, args.iters))
            ratios = "  ".join(f"{best['fp32'] / best[n]:4.2f}" for n in ("bf16", "int4", "int4-dense", "int8", "deq"))
            cells = "  ".join(f"{best[n]:7.3f}" for n in forms)
            print(f"{shape:<11} {rows:4d}  {cells} |         {ratios}")
        bf16_bytes = out * k * 2
        print(
            f"{shape:<11} resident bytes vs bf16: int4 {int4.resident_bytes() / bf16_bytes:.3f}, "
            f"int8 {int8.resident_bytes() / bf16_bytes:.3f}, dequantized {deq.resident_bytes() / bf16_bytes:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
