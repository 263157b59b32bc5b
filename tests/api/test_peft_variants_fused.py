"""rank_pattern / alpha_pattern on adapters of a base model that fuses q/k/v and gate/up (Phi-3, Phi-4): PEFT matched
the patterns against the fused modules (qkv_proj, gate_up_proj), so each part the engine holds takes its fused
module's rank and alpha. Held to transformers + PEFT token for token in one mixed batch."""

from __future__ import annotations

import pytest

from loraledger import LLM, LoRARequest, SamplingParams
from loraledger.lora.checkpoint_reader import load_lora_checkpoint
from tests.api.conftest import random_prompts
from tests.api.test_peft_variants import _save
from tests.model_fixtures import hf_reference_generate

FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
VARIANTS = {
    "fused_patterns": dict(
        r=4,
        lora_alpha=8,
        target_modules=FUSED,
        rank_pattern={"qkv_proj": 8, "model.layers.1.mlp.gate_up_proj": 16},
        alpha_pattern={"gate_up_proj": 40, "o_proj": 3},
    ),
    "fused_rslora": dict(
        r=8,
        lora_alpha=16,
        target_modules=["qkv_proj", "gate_up_proj"],
        use_rslora=True,
        rank_pattern={"gate_up_proj": 2},
    ),
}


@pytest.fixture(scope="module")
def fused_adapters(tiny_phi3, tmp_path_factory):
    root = tmp_path_factory.mktemp("peft-fused-variants")
    return {name: _save(tiny_phi3, root, name, options) for name, options in VARIANTS.items()}


def test_fused_module_patterns_match_transformers_and_peft_in_one_mixed_batch(tiny_phi3, fused_adapters):
    names = [*VARIANTS, None, "fused_patterns"]
    prompts = random_prompts(len(names), seed=43)
    ref = hf_reference_generate(tiny_phi3.model_dir, fused_adapters, prompts, names, 8, mixed=False)
    loras = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(fused_adapters.items())}
    with LLM(model=str(tiny_phi3.model_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
             block_size=4, audit_url=None) as llm:  # fmt: skip
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            lora_request=[loras[n] if n else None for n in names],
            use_tqdm=False,
        )
    assert [list(o.outputs[0].token_ids) for o in outs] == ref.token_ids
    base = ref.token_ids[len(VARIANTS)]
    assert all(ref.token_ids[i] != base for i in range(len(VARIANTS))), "every variant should change the output"


def test_each_part_takes_its_fused_modules_rank_and_alpha(tiny_phi3, fused_adapters):
    ckpt = load_lora_checkpoint(
        str(fused_adapters["fused_patterns"]), lora_name="p", lora_int_id=1, model_config=tiny_phi3.config,
        max_lora_rank=16,
    )  # fmt: skip
    ranks = {key: a.shape[0] for key, (a, _) in ckpt.weights.items()}
    assert {ranks[(0, m)] for m in ("q_proj", "k_proj", "v_proj")} == {8}
    assert (ranks[(0, "gate_proj")], ranks[(0, "up_proj")], ranks[(1, "gate_proj")], ranks[(1, "up_proj")]) == (
        4,
        4,
        16,
        16,
    )
    assert ranks[(0, "o_proj")] == ranks[(0, "down_proj")] == 4
    scales = {key: ckpt.module_scales.get(key, ckpt.scale) for key in ckpt.weights}
    assert ckpt.scale == 2.0 and scales[(0, "q_proj")] == 1.0  # qkv: alpha 8 over its rank 8
    assert scales[(0, "gate_proj")] == scales[(0, "up_proj")] == 10.0 and scales[(1, "up_proj")] == 2.5
    assert scales[(0, "o_proj")] == 0.75 and scales[(0, "down_proj")] == 2.0
