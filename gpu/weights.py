"""Base-model weights: read a Hugging Face safetensors checkpoint into our fused layout; the model fingerprint."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from loraledger import paths
from loraledger.digests import base_model_fingerprint
from loraledger.errors import ModelLoadError, QuantizationError
from loraledger.gpu.model_config import ModelConfig
from loraledger.gpu.quant_projection import DevicePart, device_parts, part_nbytes, part_rows
from loraledger.quantization import nf4
from loraledger.quantization.affine import AffineWeight
from loraledger.quantization.projection_reader import is_quantized, read_module
from loraledger.quantization.quantized_embedding import QuantizedEmbedding
from loraledger.quantization.scheme import QuantScheme

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
_FINGERPRINT_CACHE = "model_fingerprints.json"


# a projection's weight: a float tensor, or (a quantized checkpoint kept packed) its parts in fused order: for torch's
# CPU kernels the quantized parts as read (AffineWeight), for the GPU's kernels packed in the device layout
Projection = torch.Tensor | list[AffineWeight] | list[DevicePart]


def projection_shape(weight: Projection | QuantizedEmbedding) -> tuple[int, ...]:
    if isinstance(weight, torch.Tensor | QuantizedEmbedding):
        return tuple(weight.shape)
    first = weight[0]
    if isinstance(first, AffineWeight):
        return (sum(p.shape[0] for p in weight), first.shape[1])
    cols = int(first.shape[1]) if isinstance(first, torch.Tensor) else first.in_features
    return (sum(part_rows(p) for p in weight), cols)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Projection  # [q + 2 kv, H]: q_proj, k_proj, v_proj stacked
    qkv_bias: torch.Tensor | None  # [q + 2 kv] (Qwen2, attention_bias)
    o: Projection  # [H, q]
    post_norm: torch.Tensor  # [H]
    gate_up: Projection  # [2 I, H]: gate_proj, up_proj stacked
    down: Projection  # [H, I]
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3, Gemma 3: per-head RMSNorm of q and k)
    k_norm: torch.Tensor | None = None  # [head_dim]
    pre_ff_norm: torch.Tensor | None = None  # [H] (Gemma 2/3: norms before and after the MLP; post_norm then
    post_ff_norm: torch.Tensor | None = None  # [H]  normalises the attention output before the residual add)


@dataclass
class ModelWeights:
    # [V, H]; on the CPU the checkpoint's own tensor (its dtype) in a mapping of the file of its own, so only
    # the rows looked up are ever paged in, and a tied lm_head's pre-packed copy is not beside a second full one
    # or, for a GGUF file kept packed on the CPU, a QuantizedEmbedding (rows dequantized as they are looked up)
    embed: torch.Tensor | QuantizedEmbedding
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor | QuantizedEmbedding  # [V, H]; the embedding itself when tied
    # quantized projections the load dequantized to the model dtype because no packed kernel takes them: "<name>: <why>"
    dequantized: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        seen: dict[int, int] = {}
        for t in self._tensors():
            seen[t.data_ptr()] = t.numel() * t.element_size()
        packed = sum(part_nbytes(p) for p in self._device_packed())
        quantized = {id(e): e.resident_bytes() for e in (self.embed, self.lm_head) if isinstance(e, QuantizedEmbedding)}
        return sum(seen.values()) + packed + sum(quantized.values())

    def _device_packed(self) -> list[DevicePart]:
        return [
            p
            for lw in self.layers
            for w in (lw.qkv, lw.o, lw.gate_up, lw.down)
            if not isinstance(w, torch.Tensor)
            for p in w
            if not isinstance(p, AffineWeight | torch.Tensor)
        ]

    def _tensors(self) -> list[torch.Tensor]:
        out = [t for t in (self.embed, self.norm, self.lm_head) if isinstance(t, torch.Tensor)]
        for lw in self.layers:
            for w in (lw.qkv, lw.o, lw.gate_up, lw.down):
                if isinstance(w, torch.Tensor):
                    out.append(w)
                    continue
                for p in w:
                    if isinstance(p, AffineWeight):
                        out += [p.q, p.scale, p.offset]
                    elif isinstance(p, torch.Tensor):
                        out.append(p)
            out += [lw.input_norm, lw.post_norm]
            out += [t for t in (lw.qkv_bias, lw.q_norm, lw.k_norm, lw.pre_ff_norm, lw.post_ff_norm) if t is not None]
        return out


def weight_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards named by the index, or the single model.safetensors."""
    root = Path(model_dir)
    index = root / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({exc}); re-save the checkpoint") from exc
        files = [root / name for name in sorted(set(weight_map.values()))]
    elif (root / _SINGLE_FILE).is_file():
        files = [root / _SINGLE_FILE]
    else:
        raise ModelLoadError(
            f"{root} holds no {_SINGLE_FILE} or {_INDEX_FILE}: save the model with "
            "save_pretrained(..., safe_serialization=True) (PyTorch .bin checkpoints are not supported)"
        )
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"weight shards listed in {index} are missing: {missing}")
    return files


def keeps_packed(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether quantized projections stay packed for torch's CPU int4/int8 kernels (which take bf16 activations); in
    any other CPU dtype they are dequantized once, at load, to `dtype` (float32: the exact reference mode). On CUDA
    they stay packed in any dtype, in the GPU's layout (uses_device_layout)."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu"


def uses_device_layout(device: torch.device | str) -> bool:
    """Whether quantized projections are packed in the GPU's layout for CudaOps.quant_linear (on CUDA)."""
    return torch.device(device).type == "cuda"


def fuse_parts(
    parts: list[AffineWeight | torch.Tensor],
    packed: bool,
    dtype: torch.dtype,
    device,
    *,
    device_layout: bool = False,
    name: str = "",
    record: list[str] | None = None,
) -> Projection:
    """One fused projection from its parts: with `device_layout`, the GPU's packed parts (gpu/quant_projection.py:
    what it cannot hold is dequantized and named in `record`); else packed parts for the CPU where `packed` and some
    part is packable (a float part beside them becomes an exact AffineWeight); else one dense tensor in `dtype`."""
    if device_layout and any(isinstance(p, AffineWeight) for p in parts):
        return device_parts(parts, dtype=dtype, device=device, name=name, record=[] if record is None else record)
    if packed and any(isinstance(p, AffineWeight) for p in parts):
        return [p if isinstance(p, AffineWeight) else AffineWeight.exact(p) for p in parts]
    dense = [p.dense() if isinstance(p, AffineWeight) else p.to(torch.float32) for p in parts]
    return torch.cat(dense, dim=0).to(dtype).to(device)


def load_weights(
    model_dir: str | Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    quantization: QuantScheme | None = None,
    device_layout: bool | None = None,
) -> ModelWeights:
    """Read the checkpoint, cast to `dtype`, fuse q/k/v and gate/up, and place everything on `device`.

    Memory: safetensors hands out tensors backed by one mapping of the whole file, which stays resident (every
    page read while loading) as long as any of them lives. So every tensor kept here owns its memory (a copy
    where the cast and the move left the mapped one), the load's mapping goes when the reader closes, and on
    the CPU the embedding is taken afresh from a new mapping that nothing has read yet (`embed`, in the
    checkpoint's dtype: the forward casts the rows it looks up). The file must then stay in place unchanged
    while the engine runs (replacing it by a rename is safe; truncating it in place is not).

    A quantized checkpoint's projections are read exactly (loraledger.quantization.projection_reader) and kept as their
    quantized parts where keeps_packed(), packed in the GPU's layout where `device_layout` (None: on CUDA; the
    emulated kernels' tests ask for it on the CPU), else dequantized once to `dtype`. A projection no packed kernel
    takes (bitsandbytes nf4) is dequantized to `dtype` and, where the weights would otherwise stay packed, named in
    ModelWeights.dequantized.
    """
    files = weight_files(model_dir)
    reader = _TensorReader(files, dtype)
    packed = keeps_packed(dtype, device)
    layout = uses_device_layout(device) if device_layout is None else device_layout
    record: list[str] = []
    found: list[str] = []  # projections stored quantized
    try:

        def get(name: str) -> torch.Tensor:
            return _owned(reader.get(name), device)

        def quantized(modules: list[str]) -> list[AffineWeight | torch.Tensor] | None:
            if quantization is not None and quantization.quantized_at_load:  # bitsandbytes nf4 of a float checkpoint
                if packed or layout:
                    record.extend(
                        f"{m}: {quantization.describe()} is a codebook no packed kernel takes" for m in modules
                    )
                return [nf4.round_trip(reader.raw(f"{m}.weight")) for m in modules]
            if quantization is None or not any(is_quantized(quantization, m, reader.has) for m in modules):
                return None
            found.append(modules[0])
            if (packed or layout) and quantization.weight_type == "nf4":
                nf4_modules = [m for m in modules if is_quantized(quantization, m, reader.has)]
                record.extend(f"{m}: bitsandbytes nf4 is a codebook no packed kernel takes" for m in nf4_modules)
            return [
                read_module(quantization, m, reader.raw, reader.has)
                if is_quantized(quantization, m, reader.has)
                else reader.raw(f"{m}.weight")
                for m in modules
            ]

        def fused(names: list[str]) -> Projection:
            parts = quantized([n.removesuffix(".weight") for n in names])
            if parts is None:
                return torch.cat([reader.get(n) for n in names], dim=0).to(device)
            return fuse_parts(
                parts, packed, dtype, device, device_layout=layout, name=names[0].removesuffix(".weight"), record=record
            )

        def norm(name: str) -> torch.Tensor:
            """An RMSNorm weight as the forward multiplies by it: Gemma stores w for (1 + w)."""
            t = reader.get(name)
            return (t.float() + config.norm_offset).to(t.dtype).to(device) if config.norm_offset else _owned(t, device)

        layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = [f"{p}self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj")]
            fused_qkv = fused([f"{p}self_attn.qkv_proj.weight"]) if config.fused_projections else None
            layers.append(
                LayerWeights(
                    input_norm=norm(f"{p}input_layernorm.weight"),
                    qkv=fused([f"{a}.weight" for a in attn]) if fused_qkv is None else fused_qkv,
                    qkv_bias=fused([f"{a}.bias" for a in attn]) if config.attention_bias else None,
                    o=fused([f"{p}self_attn.o_proj.weight"]),
                    post_norm=norm(f"{p}post_attention_layernorm.weight"),
                    gate_up=fused([f"{p}mlp.gate_up_proj.weight"])
                    if config.fused_projections
                    else fused([f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]),
                    down=fused([f"{p}mlp.down_proj.weight"]),
                    q_norm=norm(f"{p}self_attn.q_norm.weight") if config.qk_norm else None,
                    k_norm=norm(f"{p}self_attn.k_norm.weight") if config.qk_norm else None,
                    pre_ff_norm=norm(f"{p}pre_feedforward_layernorm.weight") if config.sandwich_norms else None,
                    post_ff_norm=norm(f"{p}post_feedforward_layernorm.weight") if config.sandwich_norms else None,
                )
            )
        mapped_embed = torch.device(device).type == "cpu"
        embed = None if mapped_embed else get("model.embed_tokens.weight")
        if config.tie_word_embeddings:
            lm_head = get("model.embed_tokens.weight") if mapped_embed else embed
        else:
            lm_head = get("lm_head.weight")
        final_norm = norm("model.norm.weight")
    finally:
        reader.close()
    if quantization is not None and not quantization.quantized_at_load and not found:
        raise QuantizationError(
            f"{model_dir}: config.json says the weights are {quantization.describe()}, but no projection is stored "
            "quantized (plain `weight` tensors only); fix or remove its quantization_config"
        )
    if mapped_embed:
        embed_reader = _TensorReader(files, None)
        try:
            embed = embed_reader.get("model.embed_tokens.weight")
        finally:
            embed_reader.close()
    weights = ModelWeights(embed=embed, layers=layers, norm=final_norm, lm_head=lm_head, dequantized=record)
    check_shapes(weights, config, model_dir)
    return weights


def _owned(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device` in memory of its own: a copy when the move left it in the file's mapping."""
    moved = tensor.to(device)
    return moved.clone() if moved.data_ptr() == tensor.data_ptr() else moved


class _TensorReader:
    """Finds each tensor in whichever shard holds it; errors name the file and the tensor.

    Tensors come in `dtype` (None: the checkpoint's own, still backed by the file's mapping)."""

    def __init__(self, files: list[Path], dtype: torch.dtype | None) -> None:
        self.dtype = dtype
        self._handles = []
        self._where: dict[str, int] = {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own SafetensorError, plus OSError
                self.close()
                raise ModelLoadError(
                    f"{path} is not a readable safetensors file ({exc}); the checkpoint is corrupt"
                ) from exc
            for key in handle.keys():
                self._where[key] = len(self._handles)
            self._handles.append((path, handle))

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        tensor = self.raw(name)
        return tensor if self.dtype is None else tensor.to(self.dtype)

    def raw(self, name: str) -> torch.Tensor:
        """The tensor as stored (a quantized checkpoint's packed integers keep their dtype)."""
        at = self._where.get(name)
        if at is None:
            files = ", ".join(str(p) for p, _ in self._handles)
            raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint ({files})")
        path, handle = self._handles[at]
        try:
            tensor = handle.get_tensor(name)
        except Exception as exc:
            raise ModelLoadError(
                f"tensor {name!r} in {path} cannot be read ({exc}); the checkpoint is corrupt"
            ) from exc
        return tensor

    def close(self) -> None:
        self._handles.clear()


def check_shapes(weights: ModelWeights, config: ModelConfig, model_dir: str | Path) -> None:
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    qkv = config.q_size + 2 * config.kv_size
    expected: list[tuple[str, Projection, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", weights.embed, (v, h)),
        ("model.norm.weight", weights.norm, (h,)),
        ("lm_head.weight", weights.lm_head, (v, h)),
    ]
    for n, lw in enumerate(weights.layers):
        p = f"model.layers.{n}."
        expected += [
            (f"{p}self_attn.q/k/v_proj.weight", lw.qkv, (qkv, h)),
            (f"{p}self_attn.o_proj.weight", lw.o, (h, config.q_size)),
            (f"{p}mlp.gate/up_proj.weight", lw.gate_up, (2 * i, h)),
            (f"{p}mlp.down_proj.weight", lw.down, (h, i)),
            (f"{p}input_layernorm.weight", lw.input_norm, (h,)),
            (f"{p}post_attention_layernorm.weight", lw.post_norm, (h,)),
        ]
        if lw.qkv_bias is not None:
            expected.append((f"{p}self_attn.q/k/v_proj.bias", lw.qkv_bias, (qkv,)))
        for name, tensor in (("q_norm", lw.q_norm), ("k_norm", lw.k_norm)):
            if tensor is not None:
                expected.append((f"{p}self_attn.{name}.weight", tensor, (config.head_dim,)))
        for name, tensor in (
            ("pre_feedforward_layernorm", lw.pre_ff_norm),
            ("post_feedforward_layernorm", lw.post_ff_norm),
        ):
            if tensor is not None:
                expected.append((f"{p}{name}.weight", tensor, (h,)))
    for name, tensor, shape in expected:
        if projection_shape(tensor) != shape:
            raise ModelLoadError(
                f"{model_dir}: {name} has shape {projection_shape(tensor)}, config.json implies {shape}; "
                "the weights do not belong to this config"
            )


def model_fingerprint(model_dir: str | Path, *, cache_dir: str | Path | None = None) -> str:
    """sha256 over the canonical config.json and every weight file's name and bytes (files in name order; DIGESTS.md).

    The result is cached in loraledger's cache folder (loraledger.paths; never in the model folder), keyed by the folder's
    absolute path and each file's size and mtime, so a large model is hashed once, not at every start.
    """
    root = Path(model_dir).resolve()
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{config_path} not found: the model folder must hold a Hugging Face config.json")
    files = [config_path, *weight_files(root)]
    stats = [[f.name, st.st_size, st.st_mtime_ns] for f in files for st in [f.stat()]]
    cache_file = Path(cache_dir or paths.cache_dir()) / _FINGERPRINT_CACHE
    cache = _read_cache(cache_file)
    entry = cache.get(str(root))
    if isinstance(entry, dict) and entry.get("stats") == stats and isinstance(entry.get("fingerprint"), str):
        return entry["fingerprint"]
    fingerprint = _hash_model(config_path, files[1:])
    cache[str(root)] = {"stats": stats, "fingerprint": fingerprint}
    _write_cache(cache_file, cache)
    return fingerprint


def _hash_model(config_path: Path, weight_paths: list[Path]) -> str:
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{config_path} is not valid JSON: {exc}") from exc
    return base_model_fingerprint(config, weight_paths)


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # a missing or damaged cache only costs a rehash
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, cache: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache folder must not stop the engine; the next start rehashes
