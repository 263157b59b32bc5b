"""The base model an engine serves, whatever it is stored as: a Hugging Face checkpoint folder (float or quantized:
its config.json's quantization_config) or a GGUF file. One place answers what its config is, how its weights are
quantized, how they load, and what its fingerprint covers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loraledger.digests import base_model_fingerprint
from loraledger.errors import ModelLoadError, QuantizationError
from loraledger.gpu import gguf_weights
from loraledger.gpu.model_config import ModelConfig
from loraledger.gpu.weights import ModelWeights, load_weights, model_fingerprint, weight_files
from loraledger.quantization.detection import detect_quantization
from loraledger.quantization.scheme import QuantScheme


def read_config(model: str | Path) -> ModelConfig:
    if gguf_weights.is_gguf(model):
        return gguf_weights.gguf_model_config(model)
    return ModelConfig.from_pretrained(model)


def read_quantization(model: str | Path, requested: str | None = None) -> QuantScheme | None:
    """The model's QuantScheme (None: float weights), checked against EngineArgs.quantization (`requested`)."""
    if gguf_weights.is_gguf(model):
        if requested not in (None, "gguf"):
            raise QuantizationError(
                f"quantization={requested!r} was asked for but {Path(model).name} is a GGUF file; pass "
                "quantization='gguf' or leave it unset"
            )
        return gguf_weights.gguf_quantization(model)
    path = Path(model) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} cannot be read as JSON ({exc})") from exc
    if requested == "gguf":
        raise QuantizationError(
            f"quantization='gguf' was asked for but {model} is a checkpoint folder; name a .gguf file"
        )
    return detect_quantization(raw, requested)


def check_device(scheme: QuantScheme | None, device: torch.device) -> None:
    """Quantized weights run on the CPU (torch's int4/int8 kernels) and on CUDA (the W4A16 / W8A16 kernels of
    gpu/ops_quant.py, weights in the device layout; what that layout cannot hold is dequantized at load, on record
    in the log). Any other device has no kernel for them."""
    if scheme is not None and device.type not in ("cpu", "cuda"):
        raise QuantizationError(
            f"a {scheme.describe()} base model runs on the CPU or a CUDA GPU, not on {device.type}; start the engine "
            "with device='cuda' or device='cpu'"
        )


def load_base(
    model: str | Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    quantization: QuantScheme | None = None,
    device_layout: bool | None = None,
) -> ModelWeights:
    """device_layout: quantized projections in the GPU's packed layout (None: on CUDA; see gpu/weights.py)."""
    if gguf_weights.is_gguf(model):
        return gguf_weights.load_gguf_weights(model, config, dtype=dtype, device=device, device_layout=device_layout)
    return load_weights(
        model, config, dtype=dtype, device=device, quantization=quantization, device_layout=device_layout
    )


def fingerprint(model: str | Path, scheme: QuantScheme | None) -> str:
    """The base-model fingerprint (DIGESTS.md): a folder's config.json and weight files (a quantized checkpoint's
    config carries its quantization_config and its files the quantized tensors); a GGUF file's bytes with the
    config read from its metadata and the quantization as loaded; a float folder quantized at load, its config with
    the quantization applied beside it."""
    if gguf_weights.is_gguf(model):
        path = Path(model)
        config = gguf_weights.gguf_config_dict(path)
        scheme = scheme or gguf_weights.gguf_quantization(path)
        return base_model_fingerprint(gguf_weights.gguf_fingerprint_config(config, scheme), [path])
    if scheme is not None and scheme.quantized_at_load:
        root = Path(model)
        config = json.loads((root / "config.json").read_text())
        return base_model_fingerprint({**config, AT_LOAD_KEY: scheme.describe()}, weight_files(root))
    return model_fingerprint(str(model))


AT_LOAD_KEY = "loraledger_quantized_at_load"  # the config member a fingerprint of a quantized-at-load model adds


def source_fingerprint(model: str | Path, scheme: QuantScheme | None) -> str | None:
    """The float checkpoint's own fingerprint where the engine quantized it at load (None otherwise)."""
    if scheme is None or not scheme.quantized_at_load:
        return None
    return model_fingerprint(str(model))
