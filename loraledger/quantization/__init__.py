"""Quantized base weights: which schemes a checkpoint may use (scheme), how they are recognised from config.json
(detection), how each format's packed tensors are laid out (packing) and the weight-only linear layers that run them
(linear)."""

from loraledger.quantization.detection import SUPPORTED, detect_quantization
from loraledger.quantization.linear import QuantizedLinear
from loraledger.quantization.scheme import QuantScheme

__all__ = ["SUPPORTED", "QuantScheme", "QuantizedLinear", "detect_quantization"]
