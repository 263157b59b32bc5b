"""QuantScheme: what a quantized checkpoint's weights are (method, bits, group, symmetry), as put on record."""

from __future__ import annotations

import msgspec


class QuantScheme(msgspec.Struct, frozen=True, kw_only=True):
    """One checkpoint's weight quantization.

    method: "compressed-tensors", "gptq", "awq", "bitsandbytes" or "gguf".
    bits: 4 or 8. group_size: input columns sharing one scale; None means one scale per output channel.
    symmetric: no zero point. desc_act: GPTQ's activation-order columns (a g_idx maps each column to its group).
    weight_type: the format's own name for the element type where it has one (bitsandbytes "nf4"/"int8",
    a GGUF tensor type such as "Q4_K"). quantized_at_load: a float checkpoint quantized by the engine at load.
    """

    method: str
    bits: int
    group_size: int | None
    symmetric: bool
    desc_act: bool = False
    weight_type: str | None = None
    quantized_at_load: bool = False

    def describe(self) -> str:
        """A short human name: "gptq 4-bit g128 asym", "compressed-tensors 8-bit per-channel sym"."""
        group = f"g{self.group_size}" if self.group_size else "per-channel"
        parts = [self.method, f"{self.bits}-bit", group, "sym" if self.symmetric else "asym"]
        if self.desc_act:
            parts.append("desc_act")
        if self.weight_type:
            parts.append(self.weight_type)
        if self.quantized_at_load:
            parts.append("quantized at load")
        return " ".join(parts)
