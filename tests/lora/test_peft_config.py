"""PEFT options, targets and per-module rank / alpha patterns: what is served, what is refused and how."""

from __future__ import annotations

import json

import pytest

from loraledger.errors import (
    AdapterFormatError,
    AdapterRankError,
    AdapterShapeError,
    AdapterTargetError,
    AdapterUnsupportedError,
)
from tests.lora.adapter_folders import copy_folder, load_adapter, raises_for, save_adapter


@pytest.mark.parametrize(
    ("lora_kwargs", "words"),
    [
        ({"use_dora": True}, ("DoRA", "not supported yet")),
        ({"modules_to_save": ["lm_head"]}, ("modules_to_save", "not supported yet")),
        ({"bias": "lora_only"}, ("bias='lora_only'", "not supported yet")),
    ],
)
def test_unsupported_features(lora_kwargs, words, model_config, tmp_path):
    folder, _ = save_adapter(tmp_path / "unsupported", **lora_kwargs)
    raises_for(AdapterUnsupportedError, folder, model_config, *words)


def test_unsupported_targets(model_config, tmp_path):
    lm_head, _ = save_adapter(tmp_path / "lm_head", target_modules=["q_proj", "lm_head"])
    raises_for(AdapterTargetError, lm_head, model_config, "lm_head", "supported targets")
    embed, _ = save_adapter(tmp_path / "embed", target_modules=["embed_tokens"])
    raises_for(AdapterTargetError, embed, model_config, "embed_tokens")
    foreign = copy_folder(lm_head, tmp_path / "foreign")
    cfg = json.loads((foreign / "adapter_config.json").read_text())
    cfg["target_modules"] = ["c_attn"]
    (foreign / "adapter_config.json").write_text(json.dumps(cfg))
    raises_for(AdapterTargetError, foreign, model_config, "matches no module")
    # the tensor names are checked too, whatever the config says
    cfg["target_modules"] = None
    (foreign / "adapter_config.json").write_text(json.dumps(cfg))
    raises_for(AdapterTargetError, foreign, model_config, "base_model.model.lm_head")


def test_rank_above_max_lora_rank(model_config, tmp_path):
    folder, _ = save_adapter(tmp_path / "r32", r=32, lora_alpha=32)
    raises_for(AdapterRankError, folder, model_config, "r=32", "max_lora_rank to at least 32", max_lora_rank=16)
    assert load_adapter(folder, model_config, max_lora_rank=32).rank == 32


def test_config_and_tensors_must_agree(adapter, model_config, tmp_path):
    folder = copy_folder(adapter[0], tmp_path / "disagree")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "k_proj", "v_proj", "down_proj"]
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    raises_for(AdapterShapeError, folder, model_config, "model.layers.0.self_attn.k_proj", "incomplete")
    cfg["target_modules"] = ["q_proj", "down_proj"]
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    raises_for(AdapterFormatError, folder, model_config, "model.layers.0.self_attn.v_proj", "does not declare")


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("rank_pattern", {"q_proj": 0}, ("rank_pattern must map module names to positive integer ranks",)),
        ("rank_pattern", ["q_proj"], ("rank_pattern must map",)),
        ("alpha_pattern", {"q_proj": float("inf")}, ("alpha_pattern must map module names to finite numbers",)),
        ("alpha_pattern", {"q_proj(": 2}, ("is not a valid regex",)),
        ("layers_to_transform", "0", ("layers_to_transform='0'",)),
        ("layers_pattern", 3, ("layers_pattern=3",)),
    ],
)
def test_malformed_per_module_options_are_refused(adapter, model_config, tmp_path, key, value, words):
    folder = copy_folder(adapter[0], tmp_path / "bad-options")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg[key] = value
    if key == "layers_pattern":
        cfg["layers_to_transform"] = [0]
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    raises_for(AdapterFormatError, folder, model_config, *words)


def test_a_rank_pattern_above_max_lora_rank_is_refused_at_its_module(model_config, tmp_path):
    folder, _ = save_adapter(tmp_path / "pattern32", r=4, lora_alpha=8, rank_pattern={"q_proj": 32})
    raises_for(
        AdapterRankError, folder, model_config, "q_proj has rank 32", "max_lora_rank to at least 32", max_lora_rank=16
    )
    assert load_adapter(folder, model_config, max_lora_rank=32).slot_rank == 32
