"""ModelConfig reads each family's published config.json as transformers does (Qwen3, Gemma 2, Gemma 3)."""

from __future__ import annotations

import pytest
import torch

from loraledger.errors import ModelLoadError
from loraledger.gpu.model_config import ModelConfig

# gemma-3-1b-it's config.json as published (transformers 4.50 era: flat rope fields, a window pattern)
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "vocab_size": 262144,
}

GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"],
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "vocab_size": 256000,
}


def test_gemma3_published_config():
    cfg = ModelConfig.from_dict(GEMMA3_1B)
    assert cfg.architecture == "gemma3" and cfg.qk_norm and cfg.sandwich_norms and cfg.scale_embedding
    assert cfg.norm_offset == 1.0 and cfg.attn_softcap is None and cfg.final_softcap is None
    assert cfg.rope_theta == 1e6 and cfg.local_rope_theta == 1e4
    # every sixth layer attends globally, the others through a 512-token window
    assert [i for i, w in enumerate(cfg.layer_windows) if w is None] == [5, 11, 17, 23]
    assert {w for w in cfg.layer_windows if w is not None} == {512}


def test_gemma3_transformers5_config_reads_the_same():
    from transformers import Gemma3TextConfig

    raw = Gemma3TextConfig(**{k: v for k, v in GEMMA3_1B.items() if k != "architectures"}).to_dict()
    raw["architectures"] = ["Gemma3ForCausalLM"]
    new, old = ModelConfig.from_dict(raw), ModelConfig.from_dict(GEMMA3_1B)
    assert (new.rope_theta, new.local_rope_theta, new.layer_windows) == (
        old.rope_theta,
        old.local_rope_theta,
        old.layer_windows,
    )


def test_gemma2_published_config():
    cfg = ModelConfig.from_dict(GEMMA2_2B)
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.query_pre_attn_scalar) == (50.0, 30.0, 256.0)
    assert cfg.layer_windows[:4] == (4096, None, 4096, None) and cfg.qk_norm is False


def test_an_activation_we_do_not_run_is_refused():
    raw = dict(GEMMA2_2B, hidden_activation="relu")
    with pytest.raises(ModelLoadError, match="activation 'relu'"):
        ModelConfig.from_dict(raw)
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 512,
        "hidden_act": "gelu",
    }
    with pytest.raises(ModelLoadError, match="supported: silu"):
        ModelConfig.from_dict(llama)


def test_phi3_base_model_equals_transformers(tiny_phi3):
    from loraledger import LLM, SamplingParams
    from tests.api.conftest import random_prompts
    from tests.model_fixtures import hf_reference_generate

    prompts = random_prompts(3, seed=4)
    ref = hf_reference_generate(tiny_phi3.model_dir, {}, prompts, [None] * 3, 8, mixed=False)
    with LLM(model=str(tiny_phi3.model_dir), dtype="float32", block_size=4, audit_url=None) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )
    assert [o.outputs[0].token_ids for o in outs] == ref.token_ids


def test_partial_rotary_is_refused():
    raw = dict(GEMMA2_2B, architectures=["Phi3ForCausalLM"], hidden_activation=None, partial_rotary_factor=0.75)
    with pytest.raises(ModelLoadError, match="partial_rotary_factor 0.75"):
        ModelConfig.from_dict(raw)


def test_a_fused_module_adapter_on_a_split_base_is_refused(tiny_phi3, tiny_llama):
    from loraledger.errors import AdapterTargetError
    from loraledger.lora.checkpoint_reader import load_lora_checkpoint

    # the Phi-3 adapter on all modules targets qkv_proj and gate_up_proj, which Llama holds apart
    with pytest.raises(AdapterTargetError, match="qkv_proj"):
        load_lora_checkpoint(
            str(tiny_phi3.adapters["all_r8"]),
            lora_name="x",
            lora_int_id=1,
            model_config=tiny_llama.config,
            max_lora_rank=16,
        )
    # and an adapter for Llama's split modules finds no module of a Phi-3 base
    with pytest.raises(AdapterTargetError, match="matches no module"):
        load_lora_checkpoint(
            str(tiny_llama.adapters["qv_r4"]),
            lora_name="x",
            lora_int_id=1,
            model_config=tiny_phi3.config,
            max_lora_rank=16,
        )


def test_a_fused_adapter_is_its_parts_with_a_shared(tiny_phi3):
    from safetensors.torch import load_file

    from loraledger.lora.checkpoint_reader import load_lora_checkpoint

    ckpt = load_lora_checkpoint(
        str(tiny_phi3.adapters["all_r8"]), lora_name="x", lora_int_id=1, model_config=tiny_phi3.config, max_lora_rank=16
    )
    sd = load_file(tiny_phi3.adapters["all_r8"] / "adapter_model.safetensors")
    a = sd["base_model.model.model.layers.1.self_attn.qkv_proj.lora_A.weight"]
    b = sd["base_model.model.model.layers.1.self_attn.qkv_proj.lora_B.weight"]
    cfg = tiny_phi3.config
    parts = [ckpt.weights[(1, m)] for m in ("q_proj", "k_proj", "v_proj")]
    assert all(torch.equal(pa[: a.shape[0]], a) for pa, _ in parts)
    assert torch.equal(torch.cat([pb[:, : a.shape[0]] for _, pb in parts]), b)
    assert [pb.shape[0] for _, pb in parts] == [cfg.q_size, cfg.kv_size, cfg.kv_size]


def test_soft_capped_attention_is_refused_on_cuda_by_name():
    cfg = ModelConfig.from_dict(GEMMA2_2B)
    cfg.check_device("cpu")
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping=50.0.*device='cpu'"):
        cfg.check_device("cuda")
    ModelConfig.from_dict(GEMMA3_1B).check_device("cuda")  # Gemma 3 caps nothing
