"""How PEFT names a base model's LoRA-targetable modules and an adapter's tensors."""

from __future__ import annotations

import re

from loraledger.gpu.config import LORA_TARGETS, ModelConfig

# the decoder block that holds each target module
BLOCK_OF = {m: ("mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn") for m in LORA_TARGETS}
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
    for layer in range(model_config.num_hidden_layers):
        names += [module_name((layer, m)) for m in LORA_TARGETS]
    return names
