"""How PEFT names a base model's LoRA-targetable modules and an adapter's tensors."""

from __future__ import annotations

import re

from loraledger.gpu.model_config import LORA_TARGETS, ModelConfig

# Phi-3's checkpoints fuse q/k/v and gate/up into one module each, and its adapters target those: a fused
# module's LoRA is its parts' LoRAs with A shared and B split by rows
FUSED_SPLITS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
FUSED_OF = {part: fused for fused, parts in FUSED_SPLITS.items() for part in parts}
# the decoder block that holds each target module
BLOCK_OF = {
    m: ("mlp" if m in ("gate_proj", "up_proj", "down_proj", "gate_up_proj") else "self_attn")
    for m in (*LORA_TARGETS, *FUSED_SPLITS)
}
# base_model.model.model.layers.3.self_attn.q_proj.lora_A[.default].weight
TENSOR_NAME = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<module>\w+)"
    r"\.(?P<ab>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight"
)


def module_name(key: tuple[int, str]) -> str:
    """The full module name PEFT matches its patterns against, of (layer, module)."""
    layer, module = key
    return f"model.layers.{layer}.{BLOCK_OF[module]}.{module}"


def candidate_modules(model_config: ModelConfig) -> list[str]:
    """Names (as PEFT matches them) of the base model's modules a LoRA could target."""
    names = ["model.embed_tokens", "lm_head"]
    modules = peft_modules(model_config)
    for layer in range(model_config.num_hidden_layers):
        names += [module_name((layer, m)) for m in modules]
    return names


def peft_modules(model_config: ModelConfig) -> tuple[str, ...]:
    """The targetable module names as the base model (and so PEFT) has them: fused ones on Phi-3."""
    if not model_config.fused_projections:
        return LORA_TARGETS
    return tuple(dict.fromkeys(FUSED_OF.get(m, m) for m in LORA_TARGETS))


def split_names(names: set[str]) -> set[str]:
    """Full module names with each fused module replaced by its parts (how the engine holds their LoRA)."""
    out = set()
    for name in names:
        prefix, _, module = name.rpartition(".")
        out.update(f"{prefix}.{part}" for part in FUSED_SPLITS.get(module, (module,)))
    return out
