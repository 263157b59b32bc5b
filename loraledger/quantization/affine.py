"""AffineWeight: one quantized projection as read from a checkpoint, before it is built for the device.

W[n, k] = q[n, k] * scale[n, g] + offset[n, g] for the group g of column k (q unsigned, `bits` wide). perm (GPTQ
desc_act) says which input column each of q's columns is: x[:, perm] @ W.T. Every format's reader produces this
form, so fusing q/k/v (or gate/up) is a concatenation of rows, and a dequantized copy is one expression.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraledger.errors import QuantizationError


@dataclass
class AffineWeight:
    q: torch.Tensor  # int32 [out, in], 0 <= q < 2**bits
    scale: torch.Tensor  # fp32 [out, groups]
    offset: torch.Tensor  # fp32 [out, groups]
    bits: int
    perm: torch.Tensor | None = None  # int64 [in]: the input column of each of q's columns

    @classmethod
    def from_zero(cls, q, scale, zero, bits, perm=None) -> AffineWeight:
        """W = (q - zero) * scale (GPTQ, AWQ, compressed-tensors): offset = -zero * scale."""
        scale = scale.to(torch.float32)
        return cls(q, scale, -zero.to(torch.float32) * scale, bits, perm)

    @classmethod
    def exact(cls, weight: torch.Tensor) -> AffineWeight:
        """A float weight fused with quantized ones (a quantizer's ignore list splitting q/k/v, a Q6_K v beside Q4_K
        q and k): exact with one group per element (q = 0, offset = the value), which QuantizedLinear runs dense."""
        w = weight.to(torch.float32)
        return cls(torch.zeros(w.shape, dtype=torch.int32), torch.ones(w.shape), w, 1)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def dense(self) -> torch.Tensor:
        """The fp32 weight [out, in] in the input's own column order."""
        out, k = self.shape
        groups = self.scale.shape[1]
        w = (
            self.q.to(torch.float32).reshape(out, groups, -1) * self.scale[..., None] + self.offset[..., None]
        ).reshape(out, k)
        if self.perm is None:
            return w
        restored = torch.empty_like(w)
        restored[:, self.perm] = w
        return restored

    def rows(self, index: torch.Tensor) -> AffineWeight:
        """The weight with its output rows reordered (GGUF's q/k rotary row order back to Hugging Face's)."""
        return AffineWeight(self.q[index], self.scale[index], self.offset[index], self.bits, self.perm)


def concat(parts: list[AffineWeight]) -> list[AffineWeight]:
    """Row-concatenate projections that share an input (q/k/v, gate/up) wherever their layouts agree (bits, group
    count, column order); the result runs as one layer per element."""
    out: list[AffineWeight] = []
    for part in parts:
        if out and _same_layout(out[-1], part):
            last = out[-1]
            out[-1] = AffineWeight(
                torch.cat([last.q, part.q]),
                torch.cat([last.scale, part.scale]),
                torch.cat([last.offset, part.offset]),
                last.bits,
                last.perm,
            )
        else:
            out.append(part)
    return out


def _same_layout(a: AffineWeight, b: AffineWeight) -> bool:
    if a.shape[1] != b.shape[1]:
        raise QuantizationError(f"fused projections read {a.shape[1]} and {b.shape[1]} input columns")
    same_perm = (a.perm is None and b.perm is None) or (
        a.perm is not None and b.perm is not None and torch.equal(a.perm, b.perm)
    )
    return a.bits == b.bits and a.scale.shape[1] == b.scale.shape[1] and same_perm
