"""loraledger.demo.lora_model: the trainer's Llama is transformers' Llama, and its LoRA is PEFT's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from loraledger.demo.lora_model import ATTENTION, MLP, LlamaShape, LoraLlama
from loraledger.demo.train import TrainSpec, save_peft_adapter
from loraledger.errors import ConfigError
from tests.model_fixtures import hf_reference_logits

IDS = [1, 40, 17, 99, 230, 5, 77, 301, 12, 64]


def _model(tiny, first_lora_layer=1, seed=3) -> LoraLlama:
    config = json.loads((tiny.model_dir / "config.json").read_text())
    weights = load_file(tiny.model_dir / "model.safetensors")
    return LoraLlama(
        weights, LlamaShape.from_config(config), first_lora_layer=first_lora_layer, targets=ATTENTION + MLP,
        rank=4, alpha=8, seed=seed,
    )  # fmt: skip


def test_base_forward_equals_transformers(tiny_llama):
    model = _model(tiny_llama)  # B starts at zero: the base model
    with torch.no_grad():
        ours = model(torch.tensor([IDS]))[0]
    torch.testing.assert_close(ours, hf_reference_logits(tiny_llama.model_dir, None, IDS), atol=1e-4, rtol=1e-4)


def test_saved_adapter_is_what_peft_loads(tiny_llama, tmp_path):
    model = _model(tiny_llama, first_lora_layer=1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.lora.items():
            if name.endswith("_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        ours = model(torch.tensor([IDS]))[0]
    spec = TrainSpec(rank=4, alpha=8, top_layers=1)
    folder = save_peft_adapter(model, tmp_path / "adapter", base_model=str(tiny_llama.model_dir), spec=spec)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["layers_to_transform"] == [1] and config["r"] == 4
    theirs = hf_reference_logits(tiny_llama.model_dir, folder, IDS)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(theirs, hf_reference_logits(tiny_llama.model_dir, None, IDS), atol=1e-2)


def test_a_shared_prefix_run_once_gives_the_same_states(tiny_llama):
    model = _model(tiny_llama, first_lora_layer=0)
    layers = range(model.shape.num_layers)
    ids = torch.tensor([IDS, IDS[:4] + [7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        whole, _ = model.run(model.embed(ids), layers)
        prefix, kv = model.run(model.embed(ids[:1, :4]), layers)
        rest, _ = model.run(model.embed(ids[:, 4:]), layers, 4, kv)
    torch.testing.assert_close(prefix[0], whole[0, :4])
    torch.testing.assert_close(rest, whole[:, 4:], atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_refused(tiny_llama):
    with pytest.raises(ConfigError, match="first_lora_layer"):
        _model(tiny_llama, first_lora_layer=2)  # the tiny model has layers 0 and 1
    config = json.loads((tiny_llama.model_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    with pytest.raises(ConfigError, match="llama3"):
        LlamaShape.from_config(config)
