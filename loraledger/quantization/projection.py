"""QuantizedProjection: a fused base projection (q/k/v, o, gate/up, down) whose weights stay quantized.

The Model calls it where it would call Dense: [T, in] activations in, [T, out] out in the activations' dtype. Each
part is one QuantizedLinear, repacked once here for torch's CPU int4/int8 kernels (bf16 activations); the parts'
outputs are joined along the output dim and the bias (Qwen2's q/k/v) added. LoRA deltas are added afterwards by
the Model, in full precision, on the same unquantized activations: adapters are never merged into these weights.
"""

from __future__ import annotations

import torch

from loraledger.quantization.affine import AffineWeight, concat
from loraledger.quantization.linear import QuantizedLinear


class QuantizedProjection:
    __slots__ = ("in_features", "out_features", "dtype", "layers", "_bias")

    def __init__(self, parts: list[AffineWeight], bias: torch.Tensor | None = None, *, dtype: torch.dtype) -> None:
        self.layers: list[QuantizedLinear] = []
        for part in concat(parts):
            layer = QuantizedLinear.from_affine(part.q, part.scale, part.offset, part.bits, dtype=dtype)
            layer.perm = part.perm
            self.layers.append(layer)
        self.in_features = self.layers[0].in_features
        self.out_features = sum(layer.out_features for layer in self.layers)
        self.dtype = dtype
        self._bias = bias

    @property
    def paths(self) -> list[str]:
        """How each part runs: "int4pack", "int8pack" or "dequantized" (QuantizedLinear.path)."""
        return [layer.path for layer in self.layers]

    def resident_bytes(self) -> int:
        bias = 0 if self._bias is None else self._bias.nbytes
        return sum(layer.resident_bytes() for layer in self.layers) + bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.layers) == 1:
            y = self.layers[0](x)
        else:
            y = torch.cat([layer(x) for layer in self.layers], dim=-1)
        return y if self._bias is None else y + self._bias
