"""Adapters that real trainers save with PEFT's per-module options, against transformers + PEFT token for token.

rank_pattern / alpha_pattern give modules their own rank and alpha (so their own scale); layers_to_transform
(with layers_pattern) puts the adapter on some layers only. PEFT's rules: a pattern key matches the end of a
module's name after a dot (the first key that matches, in the config's order); layers_to_transform applies to a
list of target names, the layer index read after the layers_pattern segment.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from loraledger import LLM, LoRARequest, SamplingParams
from tests.api.conftest import random_prompts
from tests.model_fixtures import hf_reference_generate

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = {
    "rank_alpha_patterns": dict(
        r=4,
        lora_alpha=8,
        target_modules=ALL,
        rank_pattern={"q_proj": 8, "model.layers.1.mlp.down_proj": 16},
        alpha_pattern={"v_proj": 3, "gate_proj": 40},
    ),
    "rslora_rank_pattern": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "o_proj", "up_proj"], use_rslora=True, rank_pattern={"o_proj": 2}
    ),
    "layer_1_only": dict(r=8, lora_alpha=16, target_modules=ALL, layers_to_transform=[1]),
    "layer_0_pattern": dict(
        r=4, lora_alpha=4, target_modules=["q_proj", "down_proj"], layers_to_transform=0, layers_pattern="layers"
    ),
}


def _save(tiny, root: Path, name: str, options: dict) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(hash(name) % 1000)
    base = AutoModelForCausalLM.from_pretrained(tiny.model_dir)
    model = get_peft_model(
        copy.deepcopy(base), LoraConfig(init_lora_weights=False, lora_dropout=0.0, task_type="CAUSAL_LM", **options)
    )
    folder = root / name
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def variant_adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft-variants")
    return {name: _save(tiny_llama, root, name, options) for name, options in VARIANTS.items()}


def test_peft_per_module_options_match_transformers_and_peft_in_one_mixed_batch(tiny_llama, variant_adapters):
    names = [*VARIANTS, None, "rank_alpha_patterns"]
    prompts = random_prompts(len(names), seed=41)
    ref = hf_reference_generate(tiny_llama.model_dir, variant_adapters, prompts, names, 8, mixed=False)
    loras = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(variant_adapters.items())}
    with LLM(model=str(tiny_llama.model_dir), enable_lora=True, max_loras=4, max_lora_rank=16, audit_url=None) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            lora_request=[loras[n] if n else None for n in names],
        )
    assert [o.outputs[0].token_ids for o in outs] == ref.token_ids
    base = ref.token_ids[len(VARIANTS)]
    assert all(ref.token_ids[i] != base for i in range(len(VARIANTS))), "every variant should change the output"


def test_per_module_ranks_and_layers_reach_the_checkpoint(tiny_llama, variant_adapters):
    from loraledger.lora.checkpoint_reader import load_lora_checkpoint

    def load(name):
        return load_lora_checkpoint(
            str(variant_adapters[name]), lora_name=name, lora_int_id=1, model_config=tiny_llama.config, max_lora_rank=16
        )

    patterns = load("rank_alpha_patterns")
    assert patterns.weights[(0, "q_proj")][0].shape[0] == 8 and patterns.weights[(1, "down_proj")][0].shape[0] == 16
    assert patterns.weights[(0, "down_proj")][0].shape[0] == 4
    assert (patterns.rank, patterns.slot_rank) == (4, 16)
    assert patterns.module_scales[(0, "v_proj")] == pytest.approx(3 / 4) and patterns.module_scales[
        (0, "q_proj")
    ] == pytest.approx(8 / 8)
    assert (0, "k_proj") not in patterns.module_scales and patterns.scale == pytest.approx(2.0)
    assert {layer for layer, _ in load("layer_1_only").weights} == {1}
    assert set(load("layer_0_pattern").weights) == {(0, "q_proj"), (0, "down_proj")}
