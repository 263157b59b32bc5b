"""loraledger.assets: transformers loads the tokenizer and checkpoints, real peft loads the adapters."""

from __future__ import annotations

import json

import pytest
import torch

from loraledger.assets import build_random_adapter, build_random_checkpoint, build_tokenizer
from loraledger.errors import ConfigError
from loraledger.gpu.model_config import ModelConfig


def test_tokenizer_loads_with_autotokenizer_and_prepends_bos(tmp_path):
    from transformers import AutoTokenizer

    size = build_tokenizer(tmp_path, vocab_size=400)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert size == 400 == len(tok)
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 3)
    text = "The engine keeps one base model, and a ledger records every answer."
    ids = tok(text).input_ids
    assert ids[0] == 1 and 1 not in ids[1:]
    assert len(ids) < len(text) // 2  # merges were learned
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok("unseen wörds ✓").input_ids, skip_special_tokens=True) == "unseen wörds ✓"  # byte-level


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_random_checkpoint_loads_in_transformers_and_generates_varied_tokens(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    build_random_checkpoint(
        tmp_path,
        arch=arch,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=300,
        max_position_embeddings=128,
        seed=3,
        dtype="float32",
    )
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert (cfg.architecture, cfg.vocab_size, cfg.num_key_value_heads) == (arch, 300, 2)
    assert cfg.tie_word_embeddings == (arch == "qwen2") and cfg.attention_bias == (arch == "qwen2")
    with torch.no_grad():
        out = model.generate(
            torch.tensor([[1, 20, 30, 40]]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=3
        )
    assert len(set(out[0, 4:].tolist())) >= 4


def test_random_adapter_loads_in_peft_with_its_exact_weights_and_scale(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, adapter_dir = tmp_path / "m", tmp_path / "a"
    build_random_checkpoint(model_dir, arch="llama", vocab_size=300, seed=1)
    build_random_adapter(
        adapter_dir,
        model_dir,
        rank=4,
        alpha=8,
        target_modules=["v_proj", "q_proj", "down_proj"],
        seed=5,
        use_rslora=True,
    )
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["q_proj", "v_proj", "down_proj"] and cfg["peft_type"] == "LORA"
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([[1, 20, 30, 40, 50]])
    with torch.no_grad():
        base_logits = base(ids).logits
    peft_model = PeftModel.from_pretrained(base, adapter_dir)
    layer = peft_model.base_model.model.model.layers[1]
    assert layer.mlp.down_proj.scaling["default"] == pytest.approx(8 / 2.0)  # rslora: alpha / sqrt(r)
    from safetensors.torch import load_file

    saved = load_file(adapter_dir / "adapter_model.safetensors")
    b = saved["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert torch.equal(layer.mlp.down_proj.lora_B["default"].weight, b) and b.abs().min() > 0
    assert not hasattr(layer.mlp.up_proj, "lora_A")
    with torch.no_grad():
        assert not torch.allclose(peft_model(ids).logits, base_logits, atol=1e-3)


def test_asset_builders_reject_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="arch"):
        build_random_checkpoint(tmp_path, arch="gpt2")
    build_random_checkpoint(tmp_path / "m", vocab_size=300)
    with pytest.raises(ConfigError, match="target_modules"):
        build_random_adapter(tmp_path / "a", tmp_path / "m", rank=4, alpha=8, target_modules=["lm_head"], seed=0)
    with pytest.raises(ConfigError, match="vocab_size"):
        build_tokenizer(tmp_path / "t", vocab_size=100)
