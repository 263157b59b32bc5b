"""Checkpoint loading into the fused layout (single file, sharded, corrupt) and the cached model fingerprint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraledger.errors import ModelLoadError
from loraledger.gpu import weights as weights_mod
from loraledger.gpu.weights import load_weights, model_fingerprint


def _copy(tiny, dest):
    shutil.copytree(tiny.model_dir, dest)
    return dest


def test_fused_layout_matches_the_hf_tensors(tiny_qwen2):
    cfg = tiny_qwen2.config
    w = load_weights(tiny_qwen2.model_dir, cfg, dtype=torch.float32, device="cpu")
    sd = load_file(tiny_qwen2.model_dir / "model.safetensors")
    p = "model.layers.1."
    qkv = torch.cat([sd[f"{p}self_attn.{m}.weight"] for m in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(w.layers[1].qkv, qkv)
    bias = torch.cat([sd[f"{p}self_attn.{m}.bias"] for m in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(w.layers[1].qkv_bias, bias)
    assert torch.equal(w.layers[1].gate_up, torch.cat([sd[f"{p}mlp.gate_proj.weight"], sd[f"{p}mlp.up_proj.weight"]]))
    # tied: on the CPU the embedding is the checkpoint's own tensor in a mapping of its own (its dtype), and the
    # lm_head a copy in memory of its own (which the model pre-packs)
    assert torch.equal(w.lm_head, w.embed) and w.lm_head.data_ptr() != w.embed.data_ptr()
    half = load_weights(tiny_qwen2.model_dir, cfg, dtype=torch.bfloat16, device="cpu")
    assert half.layers[0].down.dtype == half.lm_head.dtype == torch.bfloat16 and half.embed.dtype == torch.float32
    assert (half.nbytes - half.embed.nbytes) * 2 == w.nbytes - w.embed.nbytes


def test_sharded_checkpoint_loads_like_the_single_file(tiny_llama, tmp_path):
    d = _copy(tiny_llama, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, d / fname, metadata={"format": "pt"})
    (d / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = tiny_llama.config
    a = load_weights(d, cfg, dtype=torch.float32, device="cpu")
    b = load_weights(tiny_llama.model_dir, cfg, dtype=torch.float32, device="cpu")
    assert torch.equal(a.lm_head, b.lm_head) and torch.equal(a.layers[1].qkv, b.layers[1].qkv)
    assert a.layers[0].qkv_bias is None
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        load_weights(d, cfg, dtype=torch.float32, device="cpu")


def test_missing_corrupt_and_mismatched_checkpoints_raise_model_load_error(tiny_llama, tmp_path):
    cfg = tiny_llama.config
    d = _copy(tiny_llama, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match="up_proj"):
        load_weights(d, cfg, dtype=torch.float32, device="cpu")
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_weights(d, cfg, dtype=torch.float32, device="cpu")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safe_serialization"):
        load_weights(d, cfg, dtype=torch.float32, device="cpu")
    import msgspec

    wider = msgspec.structs.replace(cfg, intermediate_size=cfg.intermediate_size * 2)
    with pytest.raises(ModelLoadError, match="shape"):
        load_weights(tiny_llama.model_dir, wider, dtype=torch.float32, device="cpu")


def test_fingerprint_is_content_bound_and_cached(tiny_llama, tmp_path, monkeypatch):
    d = _copy(tiny_llama, tmp_path / "m")
    cache = tmp_path / "cache"
    first = model_fingerprint(d, cache_dir=cache)
    assert first == model_fingerprint(tiny_llama.model_dir, cache_dir=cache)  # same bytes, other folder
    calls = []
    real = weights_mod._hash_model
    monkeypatch.setattr(weights_mod, "_hash_model", lambda *a: calls.append(a) or real(*a))
    assert model_fingerprint(d, cache_dir=cache) == first and calls == []  # served from the cache
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg, indent=7))  # reformatted: same canonical config
    assert model_fingerprint(d, cache_dir=cache) == first and len(calls) == 1
    data = bytearray((d / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (d / "model.safetensors").write_bytes(bytes(data))
    assert model_fingerprint(d, cache_dir=cache) != first
    (cache / "model_fingerprints.json").write_text("{not json")
    assert model_fingerprint(d, cache_dir=cache) != first  # a damaged cache only costs a rehash


def test_config_refuses_query_heads_not_grouped_evenly_over_kv_heads():
    from loraledger.gpu.model_config import ModelConfig

    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 6,
        "num_key_value_heads": 4,
    }
    with pytest.raises(
        ModelLoadError, match=r"num_attention_heads \(6\) must be a multiple of num_key_value_heads \(4\)"
    ):
        ModelConfig.from_dict(raw)
    assert ModelConfig.from_dict({**raw, "num_key_value_heads": 3}).num_key_value_heads == 3
    assert ModelConfig.from_dict({k: v for k, v in raw.items() if k != "num_key_value_heads"}).num_key_value_heads == 6
