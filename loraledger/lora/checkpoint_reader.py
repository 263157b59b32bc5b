"""Reading one PEFT adapter folder into a LoraCheckpoint: validated against the base model, fingerprinted, stacked.

An adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (the
``adapter_model.bin`` pickle format is refused). Nothing is read whole before it is checked:
the config's size is checked before it is read, then the safetensors header (a length and a
JSON object at the start of the file) is read and every tensor's name, dtype, shape and byte
range is checked against the base model and ``max_lora_rank``, and the file's size against the
header (its data section must be exactly the tensors' bytes, as the format requires), before a
single tensor byte is read. Only then are the tensors read, each ONCE, into memory; the
fingerprint (loraledger.digests.adapter_fingerprint) and the weights both come from that one snapshot, so
the weights an engine applies are exactly the bytes the fingerprint names, even if the folder
changes meanwhile. A file of any size with a header that does not fit the base model is refused
after reading its header.

Validation (``load_lora_checkpoint`` only) raises the typed errors of
``loraledger.errors``; every message says what was wrong and what to do.
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

from loraledger.digests import adapter_fingerprint
from loraledger.gpu.model_config import LORA_TARGETS, ModelConfig
from loraledger.lora.adapter_errors import AdapterErrors
from loraledger.lora.adapter_files import adapter_files, open_weights, read_config
from loraledger.lora.checkpoint import LoraCheckpoint
from loraledger.lora.peft_config import check_supported, parse_config, patterns, rank_and_alpha, rank_error, scale_of
from loraledger.lora.peft_targets import declared_targets
from loraledger.lora.peft_tensors import build_weights, check_finite, check_tensors, group_tensors
from loraledger.lora.safetensors_header import read_header, read_tensors
from loraledger.lora.slot_stacks import stack_for_slots


def fingerprint_adapter(path: str) -> str:
    """The adapter folder's fingerprint (loraledger.digests.adapter_fingerprint); no validation beyond readability."""
    err = AdapterErrors(None, path)
    config_path, weights_path = adapter_files(Path(path), err)
    config = parse_config(read_config(config_path, err), err)
    with open_weights(weights_path, err) as f:
        raw = read_tensors(f, read_header(f, err), err)
    return adapter_fingerprint(config, raw)


def load_lora_checkpoint(
    path: str, *, lora_name: str, lora_int_id: int, model_config: ModelConfig, max_lora_rank: int
) -> LoraCheckpoint:
    """Read, validate and fingerprint one PEFT LoRA adapter folder. Touches no global state (thread-safe).

    Everything is checked before the tensors are read (see the module docstring): the memory a load
    takes is bounded by what the base model and max_lora_rank allow, whatever the file's size.
    """
    err = AdapterErrors(lora_name, path)
    config_path, weights_path = adapter_files(Path(path), err)
    config = parse_config(read_config(config_path, err), err)
    check_supported(config, err)
    rank, alpha, use_rslora = rank_and_alpha(config, err)
    per_module = patterns(config, err, fused=model_config.fused_projections)
    if rank > max_lora_rank and not per_module.ranks:
        raise rank_error(err, f"adapter rank r={rank}", rank, max_lora_rank)
    declared = declared_targets(config, model_config, err)
    with open_weights(weights_path, err) as f:
        entries = read_header(f, err)
        check_tensors(
            group_tensors(entries, err, model_config),
            per_module.rank_of(rank),
            declared,
            model_config,
            max_lora_rank,
            err,
        )
        raw = read_tensors(f, entries, err)
    fingerprint = adapter_fingerprint(config, raw)
    pairs = group_tensors(raw, err, model_config)
    weights = build_weights(pairs, err)

    scale = scale_of(rank, alpha, use_rslora)
    alpha_of = per_module.alpha_of(alpha)
    module_scales = {}
    for key, (a_w, _) in weights.items():
        own = scale_of(a_w.shape[0], alpha_of(key), use_rslora)
        if own != scale:
            module_scales[key] = own
    present = {module for _, module in weights}
    ckpt = LoraCheckpoint(
        name=lora_name,
        int_id=lora_int_id,
        path=path,
        fingerprint=fingerprint,
        rank=rank,
        alpha=alpha,
        use_rslora=use_rslora,
        scale=scale,
        target_modules=tuple(m for m in LORA_TARGETS if m in present),
        config=config,
        weights=types.MappingProxyType(weights),
        nbytes=sum(a.nbytes + b.nbytes for a, b in weights.values()),
        module_scales=types.MappingProxyType(module_scales),
        max_rank=max(a_w.shape[0] for a_w, _ in weights.values()),
    )
    stacks = stack_for_slots(model_config, max_lora_rank, ckpt)
    check_finite(pairs, weights, stacks, err)
    # the stacks hold every value of the weights: keep those, and the weights as views into them
    views = types.MappingProxyType({key: stacks.module_views[key] for key in weights})  # in the weights' order
    return dataclasses.replace(ckpt, weights=views, slot_stacks=stacks, nbytes=stacks.nbytes())
