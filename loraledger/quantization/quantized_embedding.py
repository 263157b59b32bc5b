"""QuantizedEmbedding: a token embedding (and a tied lm_head) kept quantized, rows dequantized as they are looked up.

A GGUF file's token_embd in Q4_0 / Q4_1 / Q4_K is one 4-bit AffineWeight (groups of 32); Q8_0, 8-bit, is split
exactly into two 4-bit parts, q - 128 = 16 hi + lo: W = 16 scale hi + (scale lo + offset + 128 scale). Each part is a QuantizedLinear
(torch's int4pack where its layout fits), so the same bytes serve both uses: `lookup` dequantizes only the rows of the
step's ids (the parts' rows summed), and `__call__` is the lm_head, the parts' int4 products summed in fp32 (a large
step through the dense product of int4pack_dense). Nothing is held in float beside them.
"""

from __future__ import annotations

import torch

from loraledger.quantization.affine import AffineWeight
from loraledger.quantization.linear import QuantizedLinear


def four_bit_parts(weight: AffineWeight) -> list[AffineWeight]:
    """The weight as 4-bit parts whose sum is exactly it: itself when 4-bit, hi and lo nibbles when 8-bit."""
    if weight.bits == 4:
        return [weight]
    if weight.bits != 8:
        raise ValueError(f"a {weight.bits}-bit weight has no 4-bit split")
    # signed q - 128 = 16 hi + lo (hi in [-8, 8), lo in [0, 16)): the kernel's scales and biases come out as the
    # scale times a power of two (16 s, 128 s, 8 s), so bf16 holds them exactly wherever it holds the scale
    signed = weight.q - 128
    hi = AffineWeight((signed >> 4) + 8, 16.0 * weight.scale, -128.0 * weight.scale, 4)
    lo = AffineWeight(signed & 15, weight.scale, weight.offset + 128.0 * weight.scale, 4)
    return [hi, lo]


class QuantizedEmbedding:
    __slots__ = ("parts", "dtype", "shape")

    def __init__(self, weight: AffineWeight, *, dtype: torch.dtype = torch.bfloat16) -> None:
        self.parts = [
            QuantizedLinear.from_affine(p.q, p.scale, p.offset, p.bits, dtype=dtype) for p in four_bit_parts(weight)
        ]
        self.dtype = dtype
        self.shape = weight.shape

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def paths(self) -> list[str]:
        return [p.path for p in self.parts]

    def resident_bytes(self) -> int:
        return sum(p.resident_bytes() for p in self.parts)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `ids` [T] -> [T, H] in the model dtype."""
        flat = ids.reshape(-1)
        rows = self.parts[0].rows(flat)
        for part in self.parts[1:]:
            rows = rows + part.rows(flat)
        return rows.to(self.dtype).reshape(*ids.shape, self.shape[1])

    def dense(self) -> torch.Tensor:
        """The fp32 weight [V, H] (the reference the tests compare against)."""
        return sum(p.rows(torch.arange(self.shape[0])) for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The lm_head: x [T, H] -> fp32 logits [T, V]."""
        y = self.parts[0](x).float()
        for part in self.parts[1:]:
            y += part(x).float()
        return y
