"""Dense: one base-model projection, y = x W^T (+ b), in the fastest form the device offers.

On the GPU this is F.linear (cuBLAS). On the CPU with fp32 weights, F.linear goes to MKL's sgemm, which
repacks W at every call: at decode batch sizes (a few to a few dozen rows) the repacking, not the
arithmetic, sets the time, and the lm_head of a 32k vocabulary alone took a third of a decode step.
oneDNN's linear takes W reordered once, at load time, into its blocked layout. Measured on the 2-core
reference VM (`python -m bench.dense_gemm`, bench model shapes): 1.2-3.8x faster than F.linear for the
large projections (fused gate/up, lm_head) at 4 to 64 rows, which is where a decode step spends its
time; 0.6-0.9x for the small ones at a single row (oneDNN's fixed cost per call, tens of
microseconds), and 0.86-1.0x at prefill sizes (256 to 2,048 rows). The reordered copy replaces the
plain weight, so memory does not grow; keeping both to pick per call would double it.

The op (`torch.ops.mkldnn._linear_pointwise` with `_reorder_linear_weight`) is the one torch's own
Inductor uses for frozen CPU linears; torch is pinned, and `prepack_supported()` falls back to
F.linear wherever the op is missing. Results match F.linear to fp32 rounding (a different summation
order), which the reference tests against transformers check end to end. bf16 weights are pre-packed too
on CPUs with native bf16 (AVX512-BF16 or AMX), where oneDNN's bf16 kernels accumulate in fp32.

oneDNN JIT-compiles one primitive per input shape and keeps it in two caches (its own and ideep's,
1,024 entries each by default), about half a MiB apiece. Continuous batching gives nearly every step
a new row count, so those caches grew the process by hundreds of MiB (resident memory climbing ~25 MB
per 1,000 requests with no plateau), and smaller caches only trade that for heap fragmentation from
evicting and recompiling. So only a fixed set of row counts ever reaches oneDNN: up to CHUNK_ROWS
rows are padded with zero rows (`padded_rows`: a power of two up to 16, one of 8 sizes per octave
above), and larger inputs run as CHUNK_ROWS-row pieces plus one padded remainder, their outputs
joined. That is 37 shapes per projection whatever the traffic, which both caches hold several times
over: nothing is evicted, and memory stops growing once the shapes in use have been compiled. The
padding costs nothing measurable up to 16 rows (such a call streams the weight), at most an eighth
of a call at 17 to 256 rows, and joining the pieces of a prefill-sized input 5-10% of its GEMM time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraledger.gpu import cpu_features

CHUNK_ROWS = 256  # the largest row count one oneDNN call runs with


def prepack_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True where Dense can use a oneDNN pre-packed weight: the CPU, a torch built with oneDNN, and fp32, or bf16 on
    a CPU that multiplies bf16 natively (AVX512-BF16 or AMX; elsewhere oneDNN would emulate it) and whose
    instructions oneDNN's bf16 reorder needs (an override of the native-bf16 detection cannot supply them)."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (
        torch.device(device).type == "cpu"
        and (
            dtype == torch.float32
            or (dtype == torch.bfloat16 and cpu_features.native_bf16() and cpu_features.bf16_reorder_possible())
        )
        and torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_linear_pointwise")
        and hasattr(mkldnn, "_reorder_linear_weight")
    )


class Dense:
    """A [out, in] weight (and optional [out] bias) applied to [T, in] activations, giving [T, out]."""

    __slots__ = ("in_features", "out_features", "dtype", "prepacked", "_weight", "_bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, prepack: bool = False) -> None:
        if weight.dim() != 2:
            raise ValueError(f"Dense needs a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match weight rows {weight.shape[0]}")
        if prepack and not prepack_supported(weight.device, weight.dtype):
            raise ValueError(f"cannot pre-pack a {weight.dtype} weight on {weight.device}: see prepack_supported()")
        self.out_features, self.in_features = (int(n) for n in weight.shape)
        self.dtype = weight.dtype
        self.prepacked = prepack
        self._weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None) if prepack else weight
        self._bias = bias

    def resident_bytes(self) -> int:
        """The weight's and bias's bytes (a pre-packed copy holds as many as the plain weight)."""
        bias = 0 if self._bias is None else self._bias.nbytes
        return self.out_features * self.in_features * torch.empty((), dtype=self.dtype).element_size() + bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.prepacked:
            return F.linear(x, self._weight, self._bias)
        rows = x.shape[0]
        if rows > CHUNK_ROWS:
            return torch.cat([self._packed(x[start : start + CHUNK_ROWS]) for start in range(0, rows, CHUNK_ROWS)])
        return self._packed(x)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN on at most CHUNK_ROWS rows, padded to a bucket size (see the module docstring)."""
        rows = x.shape[0]
        padded = padded_rows(rows)
        if padded != rows:
            full = x.new_empty((padded, x.shape[1]))
            full[:rows].copy_(x)
            full[rows:].zero_()
            return torch.ops.mkldnn._linear_pointwise(full, self._weight, self._bias, "none", [], "")[:rows]
        return torch.ops.mkldnn._linear_pointwise(x, self._weight, self._bias, "none", [], "")


def padded_rows(rows: int) -> int:
    """The row count a oneDNN call on `rows` (<= CHUNK_ROWS) rows runs with: the next power of two up to 16
    (a call that small costs the same whatever its rows: it streams the weight), above that rounded up to
    2^k + j * 2^(k-3) (j = 1..8) for rows in (2^k, 2^(k+1)]. 37 sizes up to 256."""
    if rows <= 16:
        return 1 << (rows - 1).bit_length() if rows > 0 else rows
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step
