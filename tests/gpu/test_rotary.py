"""Rotary tables against transformers' own rope initialisation, read back through ModelConfig."""

from __future__ import annotations

import pytest
import torch

from loraledger.errors import ModelLoadError
from loraledger.gpu.model_config import ModelConfig
from loraledger.gpu.rotary import build_cos_sin_cache

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _hf_inv_freq(hf_config) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(hf_config).inv_freq


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        LLAMA3,
    ],
)
def test_cos_sin_cache_matches_transformers_for_a_saved_config(tmp_path, rope):
    from transformers import LlamaConfig

    hf = LlamaConfig(
        hidden_size=256, num_attention_heads=4, num_hidden_layers=1, vocab_size=10, rope_parameters=dict(rope)
    )
    hf.architectures = ["LlamaForCausalLM"]
    hf.save_pretrained(tmp_path)  # transformers 5 writes rope_parameters; ModelConfig must read it back
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.rope_theta == rope["rope_theta"]
    positions = torch.arange(300)
    freqs = positions[:, None].float() * _hf_inv_freq(hf)[None, :]
    cache = build_cos_sin_cache(cfg, 300)
    assert cache.shape == (300, 64)
    torch.testing.assert_close(cache, torch.cat((freqs.cos(), freqs.sin()), -1), rtol=0, atol=1e-6)


def test_legacy_rope_scaling_key_and_unsupported_types():
    base = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=10,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        rope_theta=10000.0,
    )
    plain = build_cos_sin_cache(ModelConfig.from_dict(base), 16)
    linear = build_cos_sin_cache(ModelConfig.from_dict({**base, "rope_scaling": {"type": "linear", "factor": 2.0}}), 16)
    torch.testing.assert_close(linear[4], plain[2])  # linear scaling = positions divided by the factor
    with pytest.raises(ModelLoadError, match="yarn"):
        build_cos_sin_cache(ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}), 16)
    with pytest.raises(ModelLoadError, match="low_freq_factor"):
        build_cos_sin_cache(ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}), 16)
