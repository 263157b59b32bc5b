"""Adapter folders for the lora tests: tiny PEFT adapters saved on the fly, loaded against a tiny Llama."""

from __future__ import annotations

import shutil
from pathlib import Path

import peft
import pytest
import torch
import transformers

from loraledger.lora.checkpoint_reader import load_lora_checkpoint

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
)


def tiny_model(**overrides):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides}))


def save_adapter(folder: Path, model_overrides: dict | None = None, **lora_kwargs) -> tuple[Path, dict]:
    """Save a random (non-zero B) PEFT LoRA adapter; returns its folder and peft's own state dict."""
    lora_kwargs.setdefault("target_modules", ["q_proj", "v_proj", "down_proj"])
    config = peft.LoraConfig(
        r=lora_kwargs.pop("r", 4), lora_alpha=lora_kwargs.pop("lora_alpha", 8), init_lora_weights=False, **lora_kwargs
    )
    model = peft.get_peft_model(tiny_model(**(model_overrides or {})), config)
    model.save_pretrained(str(folder))
    return folder, peft.get_peft_model_state_dict(model)


def load_adapter(path, model_config, max_lora_rank=16):
    return load_lora_checkpoint(
        str(path), lora_name="ad", lora_int_id=1, model_config=model_config, max_lora_rank=max_lora_rank
    )


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def raises_for(cls, folder, model_config, *words, max_lora_rank=16):
    with pytest.raises(cls) as info:
        load_adapter(folder, model_config, max_lora_rank)
    message = str(info.value)
    assert info.value.lora_name == "ad" and info.value.lora_path == str(folder)
    for word in words:
        assert word in message, message
    return message
