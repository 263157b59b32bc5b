"""Which quantization a checkpoint uses, read from config.json's quantization_config as vLLM reads it, and checked
against the quantization= the caller asked for."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraledger.errors import QuantizationError
from loraledger.quantization.scheme import QuantScheme

SUPPORTED = (
    "compressed-tensors pack-quantized W4A16/W8A16 (group or channel, sym or asym)",
    "gptq 4/8-bit (any group size, desc_act)",
    "awq 4-bit GEMM",
    "bitsandbytes nf4/int8",
    "gguf Q4_0/Q4_1/Q4_K/Q8_0",
)
METHODS = ("compressed-tensors", "gptq", "awq", "bitsandbytes", "gguf")


def _refuse(what: str) -> QuantizationError:
    return QuantizationError(f"{what}; supported: {'; '.join(SUPPORTED)}")


def _bits(value: Any, allowed: tuple[int, ...], method: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value not in allowed:
        raise _refuse(f"{method} with {value!r} bits is not supported (only {', '.join(map(str, allowed))})")
    return value


def _group(value: Any, method: str) -> int | None:
    if value is None or value == -1:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _refuse(f"{method} group_size {value!r} is not a positive integer or -1 (per channel)")
    return value


def _compressed_tensors(spec: Mapping[str, Any]) -> QuantScheme:
    fmt = spec.get("format")
    groups = spec.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _refuse("compressed-tensors quantization_config has no config_groups")
    schemes = set()
    for name, group in groups.items():
        if not isinstance(group, Mapping):
            raise _refuse(f"compressed-tensors config group {name!r} is not an object")
        group_fmt = group.get("format") or fmt
        if group_fmt != "pack-quantized":
            raise _refuse(f"compressed-tensors format {group_fmt!r} is not supported (only pack-quantized)")
        if group.get("input_activations"):
            raise _refuse(f"compressed-tensors group {name!r} quantizes activations (only weight-only W4A16/W8A16)")
        weights = group.get("weights")
        if not isinstance(weights, Mapping):
            raise _refuse(f"compressed-tensors group {name!r} has no weights quantization")
        if weights.get("type", "int") != "int":
            raise _refuse(f"compressed-tensors weight type {weights.get('type')!r} is not supported (only int)")
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise _refuse(f"compressed-tensors strategy {strategy!r} is not supported (only group, channel)")
        if weights.get("dynamic") or weights.get("actorder") not in (None, False, "static", "weight", "group"):
            raise _refuse(f"compressed-tensors group {name!r}: dynamic weights or actorder {weights.get('actorder')!r}")
        bits = _bits(weights.get("num_bits"), (4, 8), "compressed-tensors")
        size = _group(weights.get("group_size"), "compressed-tensors") if strategy == "group" else None
        if strategy == "group" and size is None:
            raise _refuse("compressed-tensors group strategy without a group_size")
        schemes.add(
            QuantScheme(
                method="compressed-tensors",
                bits=bits,
                group_size=size,
                symmetric=bool(weights.get("symmetric", True)),
                desc_act=weights.get("actorder") == "group",
            )
        )
    if len(schemes) != 1:
        raise _refuse("compressed-tensors checkpoints mixing several weight schemes are not supported")
    return schemes.pop()


def _gptq(spec: Mapping[str, Any]) -> QuantScheme:
    fmt = spec.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", None):
        raise _refuse(f"gptq checkpoint_format {fmt!r} is not supported (only gptq)")
    return QuantScheme(
        method="gptq",
        bits=_bits(spec.get("bits"), (4, 8), "gptq"),
        group_size=_group(spec.get("group_size", -1), "gptq"),
        symmetric=bool(spec.get("sym", True)),
        desc_act=bool(spec.get("desc_act", False)),
    )


def _awq(spec: Mapping[str, Any]) -> QuantScheme:
    version = str(spec.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(f"awq version {version!r} is not supported (only the GEMM layout)")
    return QuantScheme(
        method="awq",
        bits=_bits(spec.get("bits", spec.get("w_bit")), (4,), "awq"),
        group_size=_group(spec.get("group_size", spec.get("q_group_size", 128)), "awq"),
        symmetric=not bool(spec.get("zero_point", True)),
    )


def _bitsandbytes(spec: Mapping[str, Any], *, at_load: bool = False) -> QuantScheme:
    if spec.get("load_in_4bit"):
        kind = spec.get("bnb_4bit_quant_type", "fp4")
        if kind != "nf4":
            raise _refuse(f"bitsandbytes 4-bit type {kind!r} is not supported (only nf4)")
        size = spec.get("bnb_4bit_blocksize", 64)
        return QuantScheme(
            method="bitsandbytes", bits=4, group_size=size, symmetric=True, weight_type="nf4", quantized_at_load=at_load
        )
    if spec.get("load_in_8bit"):
        return QuantScheme(
            method="bitsandbytes",
            bits=8,
            group_size=None,
            symmetric=True,
            weight_type="int8",
            quantized_at_load=at_load,
        )
    raise _refuse("bitsandbytes quantization_config loads neither 4-bit nor 8-bit weights")


_READERS = {"compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq, "bitsandbytes": _bitsandbytes}


def detect_quantization(config: Mapping[str, Any], requested: str | None = None) -> QuantScheme | None:
    """The checkpoint's QuantScheme from its config.json (None for float weights).

    requested is EngineArgs.quantization: None trusts the checkpoint; a method name must match what the checkpoint
    says; "bitsandbytes" on a float checkpoint quantizes it at load (nf4). Any other method is refused by name.
    """
    if requested is not None and requested not in METHODS:
        raise _refuse(f"quantization={requested!r} is not a supported method ({', '.join(METHODS)})")
    spec = config.get("quantization_config") or config.get("compression_config")
    if not spec:
        if requested == "bitsandbytes":
            return _bitsandbytes({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, at_load=True)
        if requested is not None:
            raise QuantizationError(
                f"quantization={requested!r} was asked for but config.json has no quantization_config; only "
                "'bitsandbytes' quantizes a float checkpoint at load (a GGUF model is named by its .gguf file)"
            )
        return None
    if not isinstance(spec, Mapping):
        raise _refuse(f"config.json quantization_config is a {type(spec).__name__}, not an object")
    method = str(spec.get("quant_method", "")).lower().replace("_", "-")
    if method not in _READERS:
        raise _refuse(f"quantization method {spec.get('quant_method')!r} is not supported")
    if requested is not None and requested != method:
        raise QuantizationError(
            f"quantization={requested!r} was asked for but the checkpoint is quantized with {method!r}; "
            f"pass quantization={method!r} or leave it unset"
        )
    return _READERS[method](spec)
