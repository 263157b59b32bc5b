"""A GGUF file (llama.cpp's format) as the base model, as vLLM takes it: `LLM(model="x.gguf", tokenizer=...)`.

The config comes from the file's metadata through transformers' GGUF support (the same mapping transformers uses to
load it); the tensors are read with the `gguf` package. Q4_0, Q4_1, Q8_0 and Q4_K projections are decoded exactly into
AffineWeights (loraledger.quantization.gguf_blocks) and stay packed for torch's CPU kernels where the engine keeps
weights packed, or in the GPU's layout on CUDA (all four exactly: gpu/quant_projection.py); any other type (Q6_K,
Q5_K, ...) and the norms are dequantized once by the `gguf` package, a projection among them named in
ModelWeights.dequantized. Where projections stay packed on the CPU, a token embedding (and an lm_head) of those four
types stays quantized too (QuantizedEmbedding: rows dequantized as they are looked up, a tied lm_head run from the same
bytes on the int4 kernel); elsewhere it is dequantized once. llama.cpp stores q_proj and k_proj with their rows in its own rotary order; they are put back in Hugging
Face's order (a row permutation, exact on quantized rows too).
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loraledger.errors import ModelLoadError, QuantizationError
from loraledger.gpu.model_config import ModelConfig
from loraledger.gpu.weights import (
    LayerWeights,
    ModelWeights,
    Projection,
    check_shapes,
    fuse_parts,
    keeps_packed,
    uses_device_layout,
)
from loraledger.quantization.affine import AffineWeight
from loraledger.quantization.gguf_blocks import BLOCKS, decode
from loraledger.quantization.quantized_embedding import QuantizedEmbedding
from loraledger.quantization.scheme import QuantScheme

_FLOAT_TYPES = ("F32", "F16", "BF16")
_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def is_gguf(model: str | Path) -> bool:
    return str(model).lower().endswith(".gguf")


def gguf_reader(path: str | Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({exc}); re-download or re-convert it") from exc


def _file_identity(path: str | Path) -> tuple[str, int, int]:
    """The file as the metadata caches know it: a file rewritten in place is read again."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({exc}); re-download or re-convert it") from exc
    return str(Path(path).resolve()), st.st_mtime_ns, st.st_size


def gguf_config_dict(path: str | Path) -> dict[str, Any]:
    """The Hugging Face config.json the file's metadata describes (transformers' own GGUF mapping)."""
    return copy.deepcopy(_config_dict(_file_identity(path)))


# Parsing a file's metadata reads every key, the tokenizer's vocabulary and merges included, in Python: 5-10 s for
# SmolLM2-135M's. An engine start asks for the config, the quantization and the fingerprint, each of which needs
# it: it is parsed once per file and process.
@functools.lru_cache(maxsize=8)
def _config_dict(identity: tuple[str, int, int]) -> dict[str, Any]:
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = identity[0]
    try:
        parsed = load_gguf_checkpoint(path, return_tensors=False)["config"]
        model_type = parsed.pop("model_type")
        config = AutoConfig.for_model(model_type, **parsed).to_dict()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path}: its GGUF metadata does not describe a supported model ({exc})") from exc
    for key in ("_name_or_path", "transformers_version", "quantization_config"):
        config.pop(key, None)
    return config


def gguf_model_config(path: str | Path) -> ModelConfig:
    return ModelConfig.from_dict(gguf_config_dict(path), source=str(path))


def gguf_quantization(path: str | Path) -> QuantScheme:
    """What the file's projections are stored as, for the record: their GGUF types ("Q4_K+Q6_K" for a mixed file)."""
    types = sorted(_projection_types(_file_identity(path)))
    quantized = [t for t in types if t not in _FLOAT_TYPES]
    if not quantized:
        raise QuantizationError(f"{path}: no projection is quantized (types {types}); serve the float checkpoint")
    return QuantScheme(
        method="gguf",
        bits=4 if any(t.startswith(("Q4", "Q3", "Q2", "IQ")) for t in quantized) else 8,
        group_size=32,
        symmetric=all(t in ("Q4_0", "Q8_0") for t in quantized),
        weight_type="+".join(quantized),
    )


@functools.lru_cache(maxsize=8)
def _projection_types(identity: tuple[str, int, int]) -> frozenset[str]:
    return frozenset(t.tensor_type.name for t in gguf_reader(identity[0]).tensors if is_projection_name(t.name))


def is_projection_name(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in _PROJECTIONS


def _qk_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute_weights on an index)."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


def load_gguf_weights(
    path: str | Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    device_layout: bool | None = None,
) -> ModelWeights:
    """device_layout: pack the projections in the GPU's layout (None: on CUDA), as gpu/weights.py's load_weights."""
    from gguf import dequantize

    tensors = {t.name: t for t in gguf_reader(path).tensors}
    layout = uses_device_layout(device) if device_layout is None else device_layout
    packed = keeps_packed(dtype, device) or layout
    record: list[str] = []

    def tensor(name: str):
        found = tensors.get(name)
        if found is None:
            raise ModelLoadError(f"tensor {name!r} is missing from {path}")
        return found

    def dense(name: str) -> torch.Tensor:
        t = tensor(name)
        values = np.asarray(t.data) if t.tensor_type.name in _FLOAT_TYPES else dequantize(t.data, t.tensor_type)
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        out = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(rows, int(t.shape[0]))  # a writable copy
        return (out if len(t.shape) > 1 else out.reshape(-1)).to(dtype).to(device)

    def part(name: str, heads: int | None = None) -> AffineWeight | torch.Tensor:
        t = tensor(name)
        cols, rows = int(t.shape[0]), int(t.shape[1])
        kind = t.tensor_type.name
        if kind in BLOCKS and packed:
            q, scale, offset, bits = decode(np.asarray(t.data), kind, rows, cols)
            w: AffineWeight | torch.Tensor = AffineWeight(q, scale, offset, bits)
        else:
            if packed and kind not in _FLOAT_TYPES:
                record.append(f"{name}: GGUF {kind} has no packed kernel here (only {', '.join(BLOCKS)})")
            w = dense(name)
        if heads is not None:
            index = _qk_rows(rows, heads)
            w = w.rows(index) if isinstance(w, AffineWeight) else w[index]
        return w

    def embedding(name: str) -> torch.Tensor | QuantizedEmbedding:
        t = tensor(name)
        if keeps_packed(dtype, device) and not layout and t.tensor_type.name in BLOCKS:
            q, scale, offset, bits = decode(np.asarray(t.data), t.tensor_type.name, int(t.shape[1]), int(t.shape[0]))
            quantized = QuantizedEmbedding(AffineWeight(q, scale, offset, bits), dtype=dtype)
            if set(quantized.paths) == {"int4pack"}:  # else a shape the kernel refuses: one dense copy, not two
                return quantized
        return dense(name)

    def fused(names: list[tuple[str, int | None]]) -> Projection:
        parts = [part(n, h) for n, h in names]
        return fuse_parts(parts, packed, dtype, device, device_layout=layout, name=names[0][0], record=record)

    layers = []
    for i in range(config.num_hidden_layers):
        b = f"blk.{i}."
        layers.append(
            LayerWeights(
                input_norm=dense(f"{b}attn_norm.weight"),
                qkv=fused(
                    [
                        (f"{b}attn_q.weight", config.num_attention_heads),
                        (f"{b}attn_k.weight", config.num_key_value_heads),
                        (f"{b}attn_v.weight", None),
                    ]
                ),
                qkv_bias=None,
                o=fused([(f"{b}attn_output.weight", None)]),
                post_norm=dense(f"{b}ffn_norm.weight"),
                gate_up=fused([(f"{b}ffn_gate.weight", None), (f"{b}ffn_up.weight", None)]),
                down=fused([(f"{b}ffn_down.weight", None)]),
            )
        )
    embed = embedding("token_embd.weight")
    lm_head = embed if config.tie_word_embeddings or "output.weight" not in tensors else embedding("output.weight")
    weights = ModelWeights(
        embed=embed, layers=layers, norm=dense("output_norm.weight"), lm_head=lm_head, dequantized=record
    )
    check_shapes(weights, config, path)
    return weights


def gguf_fingerprint_config(config: Mapping[str, Any], scheme: QuantScheme) -> dict[str, Any]:
    """What a GGUF model's fingerprint hashes beside the file's bytes (DIGESTS.md, base-model fingerprint)."""
    return {"gguf_config": dict(config), "quantization": scheme.describe()}
