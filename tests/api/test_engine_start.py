"""Starting the engine: max_model_len against the KV cache (with SmolLM2-135M's attention shape and length: on the
CPU's default 256 MiB cache it holds about 5,800 of its 8,192 tokens), quantized checkpoints refused, and a start
that cannot finish fails within start_timeout."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from loraledger import LLM, EngineArgs, SamplingParams
from loraledger.assets import build_tokenizer
from loraledger.errors import ConfigError, EngineStartError, ModelLoadError, PromptTooLongError
from loraledger.gpu.kv_cache import KVCache

# SmolLM2-135M's config.json where it decides the KV cache: 30 layers, 3 KV heads of 64, 8,192 positions (its 9
# query heads and 576 wide hidden state do not change the cache; 3 and 192 keep the checkpoint small)
SMOLLM2_KV = dict(num_hidden_layers=30, num_attention_heads=3, num_key_value_heads=3, head_dim=64,
                  max_position_embeddings=8192)  # fmt: skip
CPU_DEFAULT_KV_BYTES = 256 << 20


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory) -> Path:
    """A random checkpoint with SmolLM2-135M's KV shape and length (narrow elsewhere, so it builds in a second)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path_factory.mktemp("smollm2-shaped") / "model"
    vocab = build_tokenizer(model_dir, vocab_size=512)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=192, intermediate_size=64, vocab_size=vocab, bos_token_id=1, eos_token_id=2,
                         pad_token_id=3, tie_word_embeddings=True, **SMOLLM2_KV)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)
    return model_dir


def _capacity(model_dir: Path, block_size: int = 16) -> int:
    from loraledger.gpu.model_config import ModelConfig

    per_block = KVCache.bytes_per_block(ModelConfig.from_pretrained(model_dir), block_size, torch.float32)
    return CPU_DEFAULT_KV_BYTES // per_block * block_size


def test_the_models_length_is_lowered_to_what_the_kv_cache_holds_and_longer_prompts_are_refused(smollm2_shaped):
    capacity = _capacity(smollm2_shaped)
    assert 5500 < capacity < 6000  # the figure seen with the real model
    with LLM(model=str(smollm2_shaped), device="cpu", audit_url=None) as llm:
        assert llm.llm_engine.engine.max_model_len == capacity
        prompt = {"prompt_token_ids": [5 + i % 400 for i in range(6002)]}
        t = time.monotonic()
        with pytest.raises(PromptTooLongError, match=f"max_model_len is {capacity}"):
            llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - t < 10, "refused at admission, not left waiting"


def test_a_max_model_len_set_above_the_kv_cache_refuses_to_start(smollm2_shaped):
    capacity = _capacity(smollm2_shaped)
    with pytest.raises(
        ConfigError, match=f"max_model_len=8192 tokens do not fit in the KV cache, which holds {capacity}"
    ):
        LLM(model=str(smollm2_shaped), device="cpu", max_model_len=8192, audit_url=None)


def test_sequences_that_outgrow_the_cache_together_are_preempted_and_finish(smollm2_shaped):
    """12 blocks of 16 tokens: one sequence fits (max_model_len 192), two of them do not; both finish with length."""
    with LLM(model=str(smollm2_shaped), device="cpu", num_kv_blocks=12, block_size=16, audit_url=None) as llm:
        assert llm.llm_engine.engine.max_model_len == 192
        params = SamplingParams(n=2, max_tokens=None, ignore_eos=True, temperature=1.0, seed=3)
        prompt = {"prompt_token_ids": [5 + i for i in range(150)]}
        done: list = []
        worker = threading.Thread(target=lambda: done.extend(llm.generate(prompt, params, use_tqdm=False)), daemon=True)
        worker.start()
        worker.join(timeout=120)
        assert not worker.is_alive(), "a generation at the cache's edge stalled"
    [out] = done
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]
    assert [len(c.token_ids) for c in out.outputs] == [42, 42]


@pytest.mark.parametrize(
    ("weights", "error"),
    [
        ({"num_bits": 4}, "strategy None is not supported"),  # an incomplete quantization_config
        ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}, "no projection is stored quantized"),
    ],
)
def test_a_checkpoint_whose_quantization_config_does_not_fit_is_refused_at_start(tiny_llama, tmp_path, weights, error):
    import shutil

    model_dir = tmp_path / "w4a16"
    shutil.copytree(tiny_llama.model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                     "config_groups": {"group_0": {"weights": weights}}}  # fmt: skip
    (model_dir / "config.json").write_text(json.dumps(config))
    t = time.monotonic()
    with pytest.raises(ModelLoadError, match=error):
        LLM(model=str(model_dir), device="cpu", audit_url=None)
    assert time.monotonic() - t < 30


def test_a_start_that_cannot_finish_fails_within_start_timeout(tiny_llama, monkeypatch):
    """Weights that never finish loading (as a checkpoint the loader cannot make sense of did): LLM() raises
    EngineStartError at the deadline instead of waiting for ever."""
    from loraledger.gpu import model_runner

    release = threading.Event()
    real_init = model_runner.ModelRunner.__init__

    def stuck(self, *args, **kwargs):
        release.wait(60)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", stuck)
    t = time.monotonic()
    try:
        with pytest.raises(EngineStartError, match="start_timeout=2 s: loading the weights"):
            LLM(model=str(tiny_llama.model_dir), audit_url=None, start_timeout=2)
        assert time.monotonic() - t < 20
    finally:
        release.set()  # the loading thread left behind ends


def test_start_timeout_must_be_positive():
    with pytest.raises(ConfigError, match="start_timeout"):
        EngineArgs(model="x", start_timeout=0)
