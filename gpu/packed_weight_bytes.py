"""The device bytes of a quantized base model's weights as CUDA holds them, from the files' headers alone.

The KV-cache budget (gpu/kv_budget.py) is sized before any weight is loaded. A float checkpoint's weights take
numel * element_size; a quantized one's projections stay packed in the device layout
(loraledger/quantization/device_layout.py: 4- or 8-bit values, a scale per group, zero points where asymmetric, a
desc_act column order), so counting them at the float size would leave the memory 4-bit weights free unused. Each
projection is counted as the layout will hold it (layout_nbytes), or at the float size where it will be dequantized
at load (bitsandbytes nf4, GGUF types other than Q4_0 / Q4_1 / Q8_0 / Q4_K, a group the kernels cannot read); every
other tensor (embedding, norms, an unquantized lm_head) at the float size. Where the layout may take a narrower form
than the headers promise (16-bit scales an fp32 tensor happens to hold, zero points that are all the default) the
count is the wider one: an upper bound, exact for the common case of 16-bit scales.
"""

from __future__ import annotations

from pathlib import Path

from loraledger.quantization.device_layout import layout_nbytes, load_granule
from loraledger.quantization.gguf_blocks import BLOCKS
from loraledger.quantization.scheme import QuantScheme

# what marks a quantized module's tensors, per method (projection_reader's markers), and the tensor its shape is read from
_MARKERS = {"compressed-tensors": "weight_packed", "gptq": "qweight", "awq": "qweight", "bitsandbytes": "SCB"}
_SCALES = {"compressed-tensors": "weight_scale", "gptq": "scales", "awq": "scales"}


def _packed(n: int, k: int, bits: int, group: int | None, scale_bytes: int, **kw: bool) -> int | None:
    """layout_nbytes, or None where the device layout cannot hold the weight (the caller counts it dense)."""
    group = group or k
    if bits not in (4, 8) or k % group or group % load_granule(bits):
        return None
    return layout_nbytes(n, k, bits, group, scale_bytes=scale_bytes, **kw)


def safetensors_packed_bytes(files: list[Path], scheme: QuantScheme, element_size: int) -> int:
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, str] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                shapes[name], dtypes[name] = list(sl.get_shape()), sl.get_dtype()
    method, bits = scheme.method, scheme.bits
    marker = "weight.absmax" if method == "bitsandbytes" and bits == 4 else _MARKERS.get(method, "")
    modules = {name.removesuffix(f".{marker}") for name in shapes if name.endswith(f".{marker}")}
    total = 0
    for name, shape in shapes.items():
        owned = name.rsplit(".", 1)[0] in modules or name.split(".weight.", 1)[0] in modules
        if name.endswith(".bias") or not owned:  # a quantized module's bias stays float
            total += _numel(shape) * element_size
    for m in modules:
        scale_name = f"{m}.{_SCALES.get(method, '')}"
        scale_bytes = 2 if dtypes.get(scale_name) in ("F16", "BF16") else 4
        zeros = not scheme.symmetric
        if method == "compressed-tensors":
            n, k = shapes[f"{m}.weight_packed"][0], shapes[f"{m}.weight_packed"][1] * 32 // bits
            perm = f"{m}.weight_g_idx" in shapes
        elif method == "gptq":
            k, n = shapes[f"{m}.qweight"][0] * 32 // bits, shapes[f"{m}.qweight"][1]
            perm = scheme.desc_act
        elif method == "awq":
            k, n = shapes[f"{m}.qweight"][0], shapes[f"{m}.qweight"][1] * 32 // bits
            perm = False
        elif bits == 8:  # bitsandbytes int8: int8 [N, K] with one fp32 SCB a row
            n, k = shapes[f"{m}.weight"]
            perm = False
        else:  # nf4: two codes a byte, dequantized at load
            total += 2 * _numel(shapes[f"{m}.weight"]) * element_size
            continue
        packed = _packed(n, k, bits, scheme.group_size, scale_bytes, zeros=zeros, offsets=False, perm=perm)
        total += n * k * element_size if packed is None else packed
    return total


def gguf_packed_bytes(path: Path, element_size: int) -> int:
    from loraledger.gpu.gguf_weights import gguf_reader, is_projection_name

    total = 0
    for t in gguf_reader(path).tensors:
        kind = t.tensor_type.name
        numel = _numel([int(d) for d in t.shape])
        if not is_projection_name(t.name) or kind not in BLOCKS:
            total += numel * element_size
            continue
        k = int(t.shape[0])
        n = numel // k
        bits, scale_bytes, offsets = {"Q4_0": (4, 2, False), "Q4_1": (4, 2, True), "Q8_0": (8, 2, False)}.get(
            kind,
            (4, 4, True),  # Q4_K: fp32 scales and mins (gpu/quant_projection.py)
        )
        packed = _packed(n, k, bits, 32, scale_bytes, zeros=False, offsets=offsets, perm=False)
        total += numel * element_size if packed is None else packed
    return total


def dequantize_scratch_bytes(shapes: dict[str, tuple[int, int]], element_size: int) -> int:
    """The largest fused projection in the activations' dtype: the weight a prefill step dequantizes for cuBLAS
    (gpu/ops_quant.py), one at a time. shapes: ModelConfig.module_shapes() (in, out per module)."""
    fused = {
        "qkv": (shapes["q_proj"][0], shapes["q_proj"][1] + shapes["k_proj"][1] + shapes["v_proj"][1]),
        "gate_up": (shapes["gate_proj"][0], 2 * shapes["gate_proj"][1]),
        "o": shapes["o_proj"],
        "down": shapes["down_proj"],
    }
    return max(i * o for i, o in fused.values()) * element_size


def _numel(shape: list[int]) -> int:
    count = 1
    for d in shape:
        count *= int(d)
    return count
