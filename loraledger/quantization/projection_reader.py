"""One projection of a quantized safetensors checkpoint, read into an AffineWeight (packing.py has each layout).

A module is quantized when its format's tensors are there (compressed-tensors `weight_packed`, GPTQ/AWQ `qweight`,
bitsandbytes int8 `SCB`, nf4 `weight.absmax`); a module the quantizer left out (an `ignore` list) keeps a plain `weight`, read as float.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loraledger.errors import QuantizationError
from loraledger.quantization import packing
from loraledger.quantization.affine import AffineWeight
from loraledger.quantization.scheme import QuantScheme

Getter = Callable[[str], torch.Tensor]  # a tensor by its checkpoint name, as stored
Has = Callable[[str], bool]

_MARKERS = {"compressed-tensors": "weight_packed", "gptq": "qweight", "awq": "qweight", "bitsandbytes": "SCB"}


def is_quantized(scheme: QuantScheme, prefix: str, has: Has) -> bool:
    """Whether module `prefix` (e.g. "model.layers.0.self_attn.q_proj") is stored quantized."""
    marker = _MARKERS.get(scheme.method)
    if scheme.method == "bitsandbytes" and scheme.bits == 4:
        marker = "weight.absmax"
    return marker is not None and has(f"{prefix}.{marker}")


def read_module(scheme: QuantScheme, prefix: str, get: Getter, has: Has) -> AffineWeight | torch.Tensor:
    """The quantized module at `prefix` as an AffineWeight (exact: no value is rounded on the way), or as its fp32
    weight where no integer kernel takes the format (nf4)."""
    method = scheme.method
    try:
        if method == "compressed-tensors":
            return _compressed_tensors(scheme, prefix, get, has)
        if method == "gptq":
            g_idx = get(f"{prefix}.g_idx") if has(f"{prefix}.g_idx") else None
            q, scale, zero, perm = packing.gptq_grouped(
                get(f"{prefix}.qweight"),
                get(f"{prefix}.qzeros"),
                get(f"{prefix}.scales"),
                g_idx,
                scheme.bits,
                scheme.group_size,
            )
            return AffineWeight.from_zero(q, scale, zero, scheme.bits, perm)
        if method == "awq":
            q, scale, zero = packing.awq_unpack(
                get(f"{prefix}.qweight"), get(f"{prefix}.qzeros"), get(f"{prefix}.scales")
            )
            return AffineWeight.from_zero(q, scale, zero, 4)
        if method == "bitsandbytes" and scheme.bits == 4:
            return bnb_nf4_dense(prefix, get, has)
        if method == "bitsandbytes" and scheme.bits == 8:
            w = get(f"{prefix}.weight")
            scale = (get(f"{prefix}.SCB").to(torch.float32) / 127.0).reshape(-1, 1)
            return AffineWeight((w.to(torch.int32) + 128), scale, -128.0 * scale, 8)
    except (RuntimeError, IndexError, ValueError, KeyError) as exc:
        raise QuantizationError(f"{prefix}: the {method} tensors do not describe one layer ({exc})") from exc
    raise QuantizationError(f"{prefix}: reading {scheme.describe()} weights is not implemented")


def _compressed_tensors(scheme: QuantScheme, prefix: str, get: Getter, has: Has) -> AffineWeight:
    shape = get(f"{prefix}.weight_shape").tolist() if has(f"{prefix}.weight_shape") else None
    packed = get(f"{prefix}.weight_packed")
    in_features = int(shape[1]) if shape else packed.shape[1] * 32 // scheme.bits
    zero = get(f"{prefix}.weight_zero_point") if has(f"{prefix}.weight_zero_point") else None
    q, scale, zero_u = packing.compressed_tensors_unpack(
        packed, get(f"{prefix}.weight_scale"), zero, scheme.bits, in_features
    )
    perm = None
    if has(f"{prefix}.weight_g_idx"):  # activation order: columns of a group are scattered, as GPTQ's desc_act
        g_idx = get(f"{prefix}.weight_g_idx").to(torch.int64)
        order = torch.argsort(g_idx, stable=True)
        if not torch.equal(order, torch.arange(in_features)):
            perm, q = order, q[:, order].contiguous()
    return AffineWeight.from_zero(q, scale, zero_u, scheme.bits, perm)


def bnb_nf4_dense(prefix: str, get: Getter, has: Has) -> torch.Tensor:
    """The fp32 weight of a bitsandbytes 4-bit (nf4) layer as bitsandbytes serializes it: `weight` holds two 4-bit
    codes a byte (the first element in the high nibble), `weight.quant_map` the 16 code values, `weight.absmax` one
    scale per block of `blocksize` elements; with double quantization (`nested_*`) absmax is itself 8-bit codes into
    `weight.nested_quant_map`, scaled per block of `nested_blocksize` by `weight.nested_absmax`, plus
    `nested_offset`. The JSON in `weight.quant_state.bitsandbytes__nf4` gives the shape and block sizes. NF4 levels
    are not evenly spaced, so no integer kernel takes them: the layer is dequantized once, at load."""
    import json

    state_key = f"{prefix}.weight.quant_state.bitsandbytes__nf4"
    if not has(state_key):
        raise QuantizationError(f"{prefix}: no {state_key} (only nf4 is supported, not fp4)")
    state = json.loads(bytes(get(state_key).to(torch.uint8).tolist()).decode())
    out, k = (int(n) for n in state["shape"])
    packed = get(f"{prefix}.weight").to(torch.uint8).reshape(-1)
    codes = torch.stack([packed >> 4, packed & 0x0F], dim=-1).reshape(-1)[: out * k].to(torch.int64)
    absmax = get(f"{prefix}.weight.absmax")
    if has(f"{prefix}.weight.nested_absmax"):
        nested = get(f"{prefix}.weight.nested_absmax").to(torch.float32)
        nested_map = get(f"{prefix}.weight.nested_quant_map").to(torch.float32)
        index = torch.arange(absmax.numel()) // int(state["nested_blocksize"])
        absmax = nested_map[absmax.to(torch.int64)] * nested[index] + float(state["nested_offset"])
    absmax = absmax.to(torch.float32)
    values = get(f"{prefix}.weight.quant_map").to(torch.float32)[codes]
    blocks = torch.arange(out * k) // int(state["blocksize"])
    return (values * absmax[blocks]).reshape(out, k)
