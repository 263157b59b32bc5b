"""DeviceQuantProjection: a fused base projection (q/k/v, o, gate/up, down) whose weights stay quantized on the GPU.

The CUDA counterpart of loraledger/quantization/projection.py. At load, each quantized part is packed once into the
device layout (loraledger/quantization/device_layout.py) and moved to the device (`device_parts`); at each call the
Model's [T, in] activations go through `ops.quant_linear`, which runs the W4A16 / W8A16 GEMV for decode-sized
token counts and dequantizes once into cuBLAS for prefill (gpu/ops_quant.py). Nothing is repacked per step.

A part the layout cannot hold (bitsandbytes nf4's codebook, a GGUF type other than Q4_0 / Q4_1 / Q8_0 / Q4_K, a
group the kernels cannot read) is a dense weight in the model dtype, dequantized once at load, and named with its
reason in the load's record (ModelWeights.dequantized), which the ModelRunner logs: what runs never changes
silently. A float part beside quantized ones (a quantizer's ignore list) is plain dense. The outputs are joined
along the output dim and the bias added; LoRA deltas are added afterwards by the Model, as on every other path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraledger.errors import QuantizationError
from loraledger.quantization.affine import AffineWeight, concat
from loraledger.quantization.device_layout import DeviceQuantWeight, from_affine

DevicePart = DeviceQuantWeight | torch.Tensor


def device_parts(
    parts: list[AffineWeight | torch.Tensor],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    name: str,
    record: list[str],
) -> list[DevicePart]:
    """One fused projection's parts on `device`: quantized runs of parts (fused where their layouts agree) in the
    device layout, float parts dense in `dtype`. A quantized part the layout refuses is dequantized, and `record`
    gets "<name>: <why>"."""
    out: list[DevicePart] = []

    def dense(t: torch.Tensor) -> None:
        t = t.to(dtype).to(device)
        if out and isinstance(out[-1], torch.Tensor):
            out[-1] = torch.cat([out[-1], t])
        else:
            out.append(t)

    run: list[AffineWeight] = []
    for part in [*parts, None]:
        if isinstance(part, AffineWeight) and part.bits > 1:  # bits 1: AffineWeight.exact, a float part
            run.append(part)
            continue
        for fused in concat(run):
            try:
                out.append(from_affine(fused.q, fused.scale, fused.offset, fused.bits, perm=fused.perm).to(device))
            except QuantizationError as exc:
                record.append(f"{name}: {exc}")
                dense(fused.dense())
        run = []
        if isinstance(part, AffineWeight):
            dense(part.dense())
        elif part is not None:
            dense(part)
    return out


def part_rows(part: DevicePart) -> int:
    return part.out_features if isinstance(part, DeviceQuantWeight) else int(part.shape[0])


def part_nbytes(part: DevicePart) -> int:
    """Device bytes a part holds (a desc_act perm included)."""
    if isinstance(part, torch.Tensor):
        return part.nbytes
    return part.packed_bytes() + (0 if part.perm is None else part.perm.nbytes)


class DeviceQuantProjection:
    """[T, in] activations in, [T, out] out in their dtype; `ops` must offer quant_linear (CudaOps)."""

    __slots__ = ("in_features", "out_features", "parts", "_bias", "_ops")

    def __init__(self, parts: list[DevicePart], bias: torch.Tensor | None, ops) -> None:
        if not hasattr(ops, "quant_linear"):
            raise QuantizationError(
                f"{type(ops).__name__} has no quantized-projection kernels; a base model packed in the GPU's layout "
                "runs with the CUDA backend (device='cuda')"
            )
        first = parts[0]
        self.in_features = first.in_features if isinstance(first, DeviceQuantWeight) else int(first.shape[1])
        self.out_features = sum(part_rows(p) for p in parts)
        self.parts = parts
        self._bias = bias
        self._ops = ops

    @property
    def paths(self) -> list[str]:
        """How each part runs: "w4a16" / "w8a16" (the device layout) or "dequantized" (dense)."""
        return [f"w{p.bits}a16" if isinstance(p, DeviceQuantWeight) else "dequantized" for p in self.parts]

    def resident_bytes(self) -> int:
        bias = 0 if self._bias is None else self._bias.nbytes
        return sum(part_nbytes(p) for p in self.parts) + bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ys = [self._ops.quant_linear(x, p) if isinstance(p, DeviceQuantWeight) else F.linear(x, p) for p in self.parts]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y if self._bias is None else y + self._bias
