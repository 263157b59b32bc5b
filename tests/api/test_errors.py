"""Every bad input gets a typed error naming the problem, and the engine keeps serving everyone else."""

from __future__ import annotations

import gc
import json
import shutil
import warnings

import pytest

from loraledger import LLM, EngineArgs, LLMEngine, LoRARequest, SamplingParams
from loraledger import errors as E
from tests.api.conftest import loras_for, random_prompts


def _greedy(n: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": -2}, "logprobs"),  # -1 asks for the whole vocabulary (vLLM)
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_values_raise_value_error(kwargs, field):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, E.SamplingParamsError)


def test_lora_request_fields():
    with pytest.raises(E.LoRARequestError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp/x")
    with pytest.raises(E.LoRARequestError, match="lora_name"):
        LoRARequest("", 1, "/tmp/x")


def _corrupt_copy(src, dst):
    shutil.copytree(src, dst)
    path = dst / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:200])
    return dst


def _edited_copy(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_adapters_and_prompts_raise_typed_errors_and_others_keep_running(tiny_llama, tiny_qwen2, tmp_path):
    loras = loras_for(tiny_llama)
    good = loras["all_r8"]
    prompt = {"prompt_token_ids": random_prompts(1, seed=30)[0]}
    no_config = tmp_path / "no-config"
    shutil.copytree(tiny_llama.adapters["qv_r4"], no_config)
    (no_config / "adapter_config.json").unlink()
    cases = [
        (LoRARequest("missing", 10, str(tmp_path / "does-not-exist")), E.AdapterNotFoundError),
        (LoRARequest("noconfig", 11, str(no_config)), E.AdapterNotFoundError),
        (
            LoRARequest("corrupt", 12, str(_corrupt_copy(tiny_llama.adapters["qv_r4"], tmp_path / "corrupt"))),
            E.AdapterFormatError,
        ),
        (
            LoRARequest("dora", 13, str(_edited_copy(tiny_llama.adapters["qv_r4"], tmp_path / "dora", use_dora=True))),
            E.AdapterUnsupportedError,
        ),
        (
            LoRARequest(
                "mts",
                14,
                str(_edited_copy(tiny_llama.adapters["qv_r4"], tmp_path / "mts", modules_to_save=["lm_head"])),
            ),
            E.AdapterUnsupportedError,
        ),
        (
            LoRARequest("bias", 15, str(_edited_copy(tiny_llama.adapters["qv_r4"], tmp_path / "bias", bias="all"))),
            E.AdapterUnsupportedError,
        ),
        (
            LoRARequest(
                "target",
                16,
                str(
                    _edited_copy(
                        tiny_llama.adapters["qv_r4"], tmp_path / "target", target_modules=["q_proj", "embed_tokens"]
                    )
                ),
            ),
            E.AdapterTargetError,
        ),
    ]
    with LLM(
        model=str(tiny_llama.model_dir),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_model_len=64,
        audit_url=None,
    ) as llm:
        expected = llm.generate(prompt, _greedy(), lora_request=good)[0].outputs[0].token_ids
        for lora, error in cases:
            with pytest.raises(error) as info:
                llm.generate(prompt, _greedy(), lora_request=lora)
            assert lora.lora_path in str(info.value) or lora.lora_name in str(info.value)
        with pytest.raises(E.AdapterRankError, match="max_lora_rank"):
            llm.generate(prompt, _greedy(), lora_request=loras["ogd_r16_rslora"])
        # an adapter made for another base model: shapes do not match (qwen2 has the same sizes, so edit a rank-4 one)
        with pytest.raises(E.PromptTooLongError, match="max_model_len"):
            llm.generate({"prompt_token_ids": [5] * 64}, _greedy())
        with pytest.raises(E.PromptError, match="empty"):
            llm.generate("", _greedy())
        with pytest.raises(E.PromptError):
            llm.generate({"prompt_token_ids": []}, _greedy())
        with pytest.raises(E.PromptError, match="vocabulary"):
            llm.generate({"prompt_token_ids": [1, 10**6]}, _greedy())
        with pytest.raises(E.LoRARequestConflictError):
            llm.generate(prompt, _greedy(), lora_request=LoRARequest("all_r8", 99, str(tiny_llama.adapters["qv_r4"])))
        with pytest.raises(E.LoRARequestConflictError):
            llm.generate(
                prompt,
                _greedy(),
                lora_request=LoRARequest("other", good.lora_int_id, str(tiny_llama.adapters["qv_r4"])),
            )
        # a batch with one bad prompt raises, and the engine still serves the same request afterwards
        with pytest.raises(E.PromptError):
            llm.generate([prompt, ""], _greedy(), lora_request=good)
        assert llm.generate(prompt, _greedy(), lora_request=good)[0].outputs[0].token_ids == expected


def test_shape_mismatch_and_lora_disabled(tiny_llama, tmp_path):
    from loraledger.assets import build_random_adapter, build_random_checkpoint, build_tokenizer

    other = tmp_path / "other-model"
    build_tokenizer(other, vocab_size=512)
    build_random_checkpoint(
        other,
        arch="llama",
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=512,
        max_position_embeddings=64,
        seed=1,
    )
    wrong = tmp_path / "wrong-shapes"
    build_random_adapter(wrong, other, rank=4, alpha=8, target_modules=["q_proj"], seed=1)
    prompt = {"prompt_token_ids": random_prompts(1, seed=31)[0]}
    with LLM(model=str(tiny_llama.model_dir), enable_lora=True, max_lora_rank=16, audit_url=None) as llm:
        with pytest.raises(E.AdapterShapeError):
            llm.generate(prompt, _greedy(), lora_request=LoRARequest("wrong", 1, str(wrong)))
    with LLM(model=str(tiny_llama.model_dir), audit_url=None) as llm:
        with pytest.raises(E.LoRADisabledError, match="enable_lora"):
            llm.generate(prompt, _greedy(), lora_request=loras_for(tiny_llama)["qv_r4"])
        assert len(llm.generate(prompt, _greedy())[0].outputs[0].token_ids) == 4


def test_duplicate_request_id_in_flight(tiny_llama):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama.model_dir), audit_url=None))
    try:
        prompt = {"prompt_token_ids": random_prompts(1, seed=32)[0]}
        engine.add_request("same", prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        with pytest.raises(E.DuplicateRequestError):
            engine.add_request("same", prompt, _greedy())
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.close()


def test_engine_args_errors(tiny_llama, tmp_path):
    with pytest.raises(E.ConfigError, match="max_cpu_loras"):
        EngineArgs(model="x", max_loras=4, max_cpu_loras=2)
    with pytest.raises(E.ConfigError, match="dtype"):
        EngineArgs(model="x", dtype="float64")
    with pytest.raises(E.ModelLoadError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"), audit_url=None)
    with pytest.raises(E.DeviceError, match="cpu"):
        LLM(model=str(tiny_llama.model_dir), device="cuda", audit_url=None)


def test_close_frees_the_model_before_returning(tiny_llama):
    """LLM.close() frees the weights on the engine's loop, not whenever a worker thread lets go of the runner
    (which, at interpreter exit, aborted the process: ModelRunner.close)."""
    llm = LLM(model=str(tiny_llama.model_dir), enable_lora=True, block_size=4, audit_url=None, seed=0)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2))
    runner = llm.llm_engine.engine._core.runner
    assert runner.model is not None
    llm.close()
    assert runner.model is None and runner.kv_cache is None and runner.lora_slots is None


@pytest.mark.parametrize("audit", [False, True])
def test_close_leaves_no_stream_open(tiny_llama, tmp_path, audit):
    """After LLM.close() every message stream of the engine is closed, the inboxes of actors it never started
    (the audit writer and lease keeper with auditing off) too: anyio warns of an unclosed one when it is collected,
    and at interpreter exit that warning was an "Exception ignored" traceback under the caller's last line."""
    url = f"sqlite:///{tmp_path / 'audit.db'}" if audit else None
    llm = LLM(model=str(tiny_llama.model_dir), block_size=4, audit_url=url, seed=0)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        llm.close()
        del llm
        gc.collect()
    unclosed = [str(w.message) for w in caught if "MemoryObject" in str(w.message)]
    assert unclosed == []
