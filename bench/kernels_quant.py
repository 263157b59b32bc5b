"""The `w4a16` cases of bench/kernels.py: CudaOps.quant_linear at decode and prefill shapes of the 1B and 8B models.

Decode rows run the W4A16 / W8A16 GEMV; it is scored by the bytes it must move (the packed weight with its scales
and zero points, x read, y written) as a share of copy bandwidth (target >= 70 % at 4 bits, one row, on the 8B
shapes), beside the bf16 dense projection of the same shape through torch (cuBLAS), scored the same way on its bf16
weight: the time ratio of the two is the decode speed-up the packed weight buys. Prefill rows run dequantize + cuBLAS
beside bf16 cuBLAS (compute-bound: times only). Every case rotates over enough copies of its weight that each call
reads it from memory, not from L2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

L2_ROTATE_BYTES = 512 << 20


@dataclass(frozen=True)
class QuantCase:
    model: str
    proj: str
    n: int
    k: int
    rows: int
    bits: int = 4
    group: int = 128
    zeros: bool = False
    target: float | None = None

    @property
    def name(self) -> str:
        zp = " zero points" if self.zeros else ""
        return f"w{self.bits}a16 {self.model} {self.proj} [{self.n} x {self.k}] g{self.group}{zp}, {self.rows} rows"


_SHAPES = (  # (model, projection, out, in): Llama-3.2-1B and Llama-3.1-8B, fused as the engine fuses them
    ("1B", "qkv", 3072, 2048),
    ("1B", "gate_up", 16384, 2048),
    ("1B", "down", 2048, 8192),
    ("8B", "qkv", 6144, 4096),
    ("8B", "gate_up", 28672, 4096),
    ("8B", "down", 4096, 14336),
)
QUANT_CASES = (
    *(QuantCase(m, p, n, k, 1, target=70.0 if m == "8B" else None) for m, p, n, k in _SHAPES),
    *(QuantCase(m, p, n, k, 8) for m, p, n, k in _SHAPES if m == "8B"),
    QuantCase("8B", "gate_up", 28672, 4096, 1, zeros=True),
    QuantCase("8B", "gate_up", 28672, 4096, 1, group=32),
    QuantCase("8B", "gate_up", 28672, 4096, 1, bits=8),
    QuantCase("8B", "gate_up", 28672, 4096, 512),
)


def _weights(case: QuantCase, copies: int, gen: torch.Generator):
    """Random packed weights made on the GPU (every bit pattern is a valid weight): no host-side packing."""
    from loraledger.quantization.device_layout import DeviceQuantWeight

    groups = case.k // case.group
    made = []
    for _ in range(copies):
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        g = torch.Generator(device="cuda").manual_seed(seed)
        qweight = torch.randint(
            -(2**31), 2**31 - 1, (case.n, case.k * case.bits // 32), generator=g, dtype=torch.int32, device="cuda"
        )
        scales = (torch.rand(case.n, groups, generator=g, device="cuda") * 0.02 + 0.001).to(torch.float16)
        zeros = None
        if case.zeros:
            zeros = torch.randint(0, 2**case.bits, (case.n, groups), generator=g, device="cuda").to(torch.float16)
        zero = float(2 ** (case.bits - 1))
        made.append(DeviceQuantWeight(qweight, scales, zeros, None, zero, case.bits, case.group, case.n, case.k))
    return made


def bench_quant(copy_gbps: float, warmup: int, iters: int, result: Callable[..., object]) -> list:
    """result: bench/kernels.py's _result (name, fn(i), bytes, copy_gbps, target, warmup, iters, variants)."""
    from loraledger.gpu.ops_cuda import CudaOps
    from loraledger.gpu.ops_quant import GEMV_MAX_TOKENS

    ops = CudaOps("cuda")
    gen = torch.Generator().manual_seed(23)
    results = []
    for case in QUANT_CASES:
        decode = case.rows <= GEMV_MAX_TOKENS
        probe = _weights(case, 1, gen)[0]
        copies = max(1, min(16, L2_ROTATE_BYTES // probe.packed_bytes()))
        weights = [probe, *_weights(case, copies - 1, gen)]
        x = torch.randn(case.rows, case.k, generator=gen).to(dtype=torch.bfloat16, device="cuda")
        io_bytes = 2 * case.rows * (case.k + case.n)
        nbytes = probe.packed_bytes() + io_bytes
        kernel = "GEMV" if decode else "dequantize + cuBLAS"
        results.append(
            result(
                f"{case.name} [{kernel}]",
                lambda i, w=weights, x=x: ops.quant_linear(x, w[i]),
                nbytes,
                copy_gbps if decode else None,
                case.target,
                warmup,
                iters,
                copies,
            )
        )
        del weights
        dense_copies = max(1, min(16, L2_ROTATE_BYTES // (2 * case.n * case.k)))
        dense = [
            (torch.randn(case.n, case.k, generator=gen) * 0.02).to(dtype=torch.bfloat16, device="cuda")
            for _ in range(dense_copies)
        ]
        results.append(
            result(
                f"{case.name} [bf16 dense, torch/cuBLAS]",
                lambda i, w=dense, x=x: x @ w[i].t(),
                2 * case.n * case.k + io_bytes,
                copy_gbps if decode else None,
                None,
                warmup,
                iters,
                dense_copies,
            )
        )
        del dense
        torch.cuda.empty_cache()
    return results
