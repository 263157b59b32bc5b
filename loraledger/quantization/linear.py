"""QuantizedLinear: a weight-only low-bit linear layer on the CPU.

4-bit weights whose group size torch's CPU kernel takes (32, 64, 128, 256), with in and out features multiples of 16, are
repacked once, at construction, for
torch.ops.aten._weight_int4pack_mm_for_cpu; 8-bit per-channel symmetric weights run torch._weight_int8pack_mm. Both
kernels take bf16 activations. Any other layout (another group size, 8-bit groups or zero points) is dequantized
once, at construction, to a dense weight (path "dequantized"). The path taken is kept in .path.

The int4 kernel's time grows with the rows; from LARGE_STEP_ROWS rows (prefill) an int4pack layer dequantizes its
packed weight into a reused per-thread bf16 scratch and runs one dense product instead (int4pack_dense.py), so the
resident weight stays packed. Measured on an AMD EPYC with AVX512-BF16 (no AMX), 2 threads, the bench model's and
SmolLM2's projections (`python -m bench.run --only quant-linear`, bench/RESULTS.md): the two meet at 96-128 rows at load
average 3.5 and at about 256 at load 6-7 (the dequantization moves memory); from 256 the dense product is never the
slower, below 64 it always is.
"""

from __future__ import annotations

import torch

from loraledger.errors import QuantizationError
from loraledger.quantization import int4pack_dense

INT4_GROUP_SIZES = (32, 64, 128, 256)
LARGE_STEP_ROWS = 256  # measured: see the docstring


class QuantizedLinear:
    """y = x @ W.T for W = (q - zero) * scale, per group of group_size input columns (all of them when None).

    q: unsigned int32 [out, in] in [0, 2^bits); scale, zero: fp32 [out, groups].
    """

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bits: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        allow_kernel: bool = True,
        perm: torch.Tensor | None = None,
    ) -> None:
        if scale.shape != zero.shape:
            raise QuantizationError(f"scale {tuple(scale.shape)} / zero {tuple(zero.shape)} differ in shape")
        self._build(q, scale, -zero * scale, bits, dtype, allow_kernel)
        # GPTQ desc_act: q's columns are x's columns in this order (x is gathered to match at each call)
        self.perm = perm

    @classmethod
    def from_affine(
        cls,
        q: torch.Tensor,
        scale: torch.Tensor,
        offset: torch.Tensor,
        bits: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        allow_kernel: bool = True,
    ) -> QuantizedLinear:
        """W = q * scale + offset per group (GGUF's Q4_1 and Q4_K write a min, not a zero point)."""
        layer = cls.__new__(cls)
        layer._build(q, scale, offset, bits, dtype, allow_kernel)
        layer.perm = None
        return layer

    def _build(self, q, scale, offset, bits, dtype, allow_kernel) -> None:
        out, k = q.shape
        scale, offset = scale.to(torch.float32), offset.to(torch.float32)
        if scale.shape != offset.shape or scale.dim() != 2 or scale.shape[0] != out or k % scale.shape[1]:
            raise QuantizationError(f"scale {tuple(scale.shape)} does not fit a [{out}, {k}] weight")
        if int(q.min()) < 0 or int(q.max()) >= 2**bits:
            raise QuantizationError(f"quantized values outside [0, {2**bits}) for a {bits}-bit weight")
        self.out_features, self.in_features, self.bits, self.dtype = out, k, bits, dtype
        self.large_step_rows = LARGE_STEP_ROWS
        self.group_size = k // scale.shape[1]
        self.path = "dequantized"
        if allow_kernel and bits == 4 and self.group_size in INT4_GROUP_SIZES and k % 16 == 0 and out % 16 == 0:
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
            # torch's kernel computes (q - 8) * scale + bias per group, so bias = 8 * scale + offset
            bias = 8.0 * scale + offset
            self._scales_and_zeros = torch.stack([scale.t(), bias.t()], dim=-1).to(torch.bfloat16).contiguous()
            self.path = "int4pack"
        elif allow_kernel and bits == 8 and scale.shape[1] == 1 and bool((offset == -128.0 * scale).all()):
            self._int8 = (q.to(torch.int32) - 128).to(torch.int8).contiguous()
            self._scales = scale[:, 0].to(torch.bfloat16).contiguous()
            self.path = "int8pack"
        else:
            groups = scale.shape[1]
            w = q.to(torch.float32).reshape(out, groups, -1) * scale[..., None] + offset[..., None]
            self._dense = w.reshape(out, k).to(dtype).contiguous()

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [out, in] this layer computes with (the reference the tests compare against)."""
        if self.path == "dequantized" and self.perm is None:
            return self._dense.to(torch.float32)
        if self.path == "int4pack" and self.perm is None and int4pack_dense.layout() is not None:
            return self.dense_int4_weight().to(torch.float32)
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return self(eye).to(torch.float32).t().contiguous()

    def dense_int4_weight(self) -> torch.Tensor:
        """The bf16 weight [out, in] an int4pack layer's kernel computes with, read back from its packed bytes."""
        return int4pack_dense.dense_weight(
            self._packed, self._scales_and_zeros, self.group_size, self.out_features, self.in_features
        )

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """fp32 rows W[index] of the weight, read without dequantizing the others (an embedding lookup)."""
        if self.path == "int4pack" and int4pack_dense.layout() is not None:
            return int4pack_dense.read_rows(
                self._packed, self._scales_and_zeros, self.group_size, self.out_features, self.in_features, index
            )
        if self.path == "int8pack":
            return self._int8[index].float() * self._scales[index].float()[:, None]
        if self.path == "dequantized" and self.perm is None:
            return self._dense[index].float()
        return self.dequantized()[index]

    def resident_bytes(self) -> int:
        if self.path == "int4pack":
            return self._packed.nbytes + self._scales_and_zeros.nbytes
        if self.path == "int8pack":
            return self._int8.nbytes + self._scales.nbytes
        return self._dense.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2[:, self.perm]
        if self.path == "int4pack" and x2.shape[0] >= self.large_step_rows and int4pack_dense.layout() is not None:
            y = int4pack_dense.linear(
                x2.to(torch.bfloat16), self._packed, self._scales_and_zeros, self.group_size, self.out_features
            )
        elif self.path == "int4pack":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16), self._packed, self.group_size, self._scales_and_zeros
            )
        elif self.path == "int8pack":
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16), self._int8, self._scales)
        else:
            y = x2.to(self.dtype) @ self._dense.t()
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)
