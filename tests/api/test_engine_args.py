"""vLLM's engine arguments: each accepted by LLM(...) and EngineArgs with its meaning here, unknown ones named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from loraledger import LLM, AsyncEngineArgs, EngineArgs, SamplingParams
from loraledger import errors as E
from loraledger.engine_setup import resolve_dtype
from tests.api.conftest import random_prompts
from tests.model_fixtures import hf_reference_generate

# vLLM's common LLM(...) arguments, each with a value a ported script passes
VLLM_ARGUMENTS = dict(
    trust_remote_code=True,
    tensor_parallel_size=1,
    pipeline_parallel_size=1,
    disable_log_stats=True,
    tokenizer_mode="auto",
    revision=None,
    tokenizer_revision=None,
    max_logprobs=20,
    generation_config="auto",
    enable_chunked_prefill=True,
    gpu_memory_utilization=0.9,
    enforce_eager=True,
    max_seq_len_to_capture=8192,
    swap_space=4,
    skip_tokenizer_init=False,
    dtype="half",
    seed=0,
    max_model_len=128,
    block_size=16,
    enable_prefix_caching=True,
    max_num_seqs=8,
    max_num_batched_tokens=512,
    enable_lora=True,
    max_loras=2,
    max_lora_rank=16,
    max_cpu_loras=4,
)


def test_every_listed_vllm_argument_is_accepted_by_llm_and_engine_args(tiny_llama):
    args = EngineArgs(model="m", **VLLM_ARGUMENTS)
    assert args.torch_dtype_name == "float16"
    assert AsyncEngineArgs(model="m", disable_log_requests=True, **VLLM_ARGUMENTS).trust_remote_code is True
    cpu_args = {**VLLM_ARGUMENTS, "dtype": "float"}  # the CPU runs float32
    with LLM(model=str(tiny_llama.model_dir), audit_url=None, **cpu_args) as llm:
        out = llm.generate(
            {"prompt_token_ids": random_prompts(1, seed=70)[0]},
            SamplingParams(temperature=0, max_tokens=3),
            use_tqdm=False,
        )
        assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    "alias, name",
    [
        ("half", "float16"),
        ("float16", "float16"),
        ("float", "float32"),
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
        ("auto", "auto"),
        ("HALF", "float16"),
        (torch.bfloat16, "bfloat16"),
    ],
)
def test_dtype_takes_vllms_aliases(alias, name, tiny_llama):
    """vLLM's dtype values: "half" is float16, "float" is float32, and a torch dtype works too."""
    args = EngineArgs(model="m", dtype=alias)
    assert args.torch_dtype_name == name
    if name != "auto":
        assert resolve_dtype(name, tiny_llama.config, torch.device("cpu")) == getattr(torch, name)


def test_an_unknown_argument_names_the_closest_known_one():
    with pytest.raises(
        E.ConfigError, match="unknown LLM argument 'tensor_paralel_size'; did you mean 'tensor_parallel_size'"
    ):
        LLM(model="m", tensor_paralel_size=1)
    with pytest.raises(
        E.ConfigError, match="unknown EngineArgs argument 'gpu_mem_utilization'; did you mean 'gpu_memory_utilization'"
    ):
        EngineArgs(model="m", gpu_mem_utilization=0.5)
    with pytest.raises(E.ConfigError, match="unknown LLM argument 'zzzz'"):
        LLM(model="m", zzzz=1)


@pytest.mark.parametrize("name", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_more_than_one_device_names_the_scale_out_path(name):
    with pytest.raises(E.ConfigError, match="Ray Serve") as info:
        EngineArgs(model="m", **{name: 2})
    assert name in str(info.value) and "replicas" in str(info.value)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"revision": ""}, ["revision", "non-empty"]),
        ({"tokenizer_revision": 3}, ["tokenizer_revision", "string"]),
        ({"download_timeout": 0}, ["download_timeout"]),
        ({"max_lora_download_bytes": 0}, ["max_lora_download_bytes"]),
        ({"tokenizer_mode": "mistral"}, ["tokenizer_mode"]),
        ({"gpu_memory_utilization": 0}, ["gpu_memory_utilization"]),
        ({"gpu_memory_utilization": 1.5}, ["gpu_memory_utilization"]),
        ({"swap_space": -1}, ["swap_space"]),
        ({"max_seq_len_to_capture": 0}, ["max_seq_len_to_capture"]),
        ({"max_logprobs": -2}, ["max_logprobs"]),
        ({"trust_remote_code": "yes"}, ["trust_remote_code"]),
        ({"enable_chunked_prefill": "no"}, ["enable_chunked_prefill"]),
        ({"dtype": "float64"}, ["dtype"]),
    ],
)
def test_bad_values_of_vllm_arguments_are_config_errors(kwargs, words):
    with pytest.raises(E.ConfigError) as info:
        EngineArgs(model="m", **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_a_checkpoint_that_needs_its_own_code_is_refused_whatever_trust_remote_code_says(tiny_llama, tmp_path):
    custom = tmp_path / "custom"
    shutil.copytree(tiny_llama.model_dir, custom)
    config = json.loads((custom / "config.json").read_text())
    config.update(
        architectures=["MyLlamaForCausalLM"],
        model_type="my_llama",
        auto_map={"AutoModelForCausalLM": "modeling_my.MyLlamaForCausalLM"},
    )
    (custom / "config.json").write_text(json.dumps(config))
    for trust in (False, True):
        with pytest.raises(E.RemoteCodeError, match="never runs code") as info:
            LLM(model=str(custom), trust_remote_code=trust, audit_url=None)
        assert isinstance(info.value, E.ModelLoadError) and "auto_map" in str(info.value)
    # a supported architecture that also carries an auto_map runs on our own implementation
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (custom / "config.json").write_text(json.dumps(config))
    with LLM(model=str(custom), trust_remote_code=True, audit_url=None) as llm:
        assert (
            len(
                llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
                .outputs[0]
                .token_ids
            )
            == 2
        )


def test_chunked_prefill_off_runs_each_prompt_in_one_step_and_needs_the_budget_for_it(tiny_llama):
    """vLLM's rule: without chunked prefill, max_num_batched_tokens must hold max_model_len (else a ConfigError);
    prompts then run whole, and greedy outputs are those of transformers."""
    with pytest.raises(E.ConfigError, match="max_num_batched_tokens"):
        LLM(
            model=str(tiny_llama.model_dir),
            enable_chunked_prefill=False,
            max_model_len=128,
            max_num_batched_tokens=64,
            audit_url=None,
        )
    prompts = random_prompts(4, seed=71, lo=30, hi=60)
    ref = hf_reference_generate(tiny_llama.model_dir, {}, prompts, [None] * 4, 5, mixed=False).token_ids
    with LLM(
        model=str(tiny_llama.model_dir),
        enable_chunked_prefill=False,
        max_model_len=128,
        max_num_batched_tokens=128,
        block_size=4,
        audit_url=None,
    ) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
            use_tqdm=False,
        )
        assert [o.outputs[0].token_ids for o in outs] == ref
        stats = llm.get_stats()
    assert stats is not None


def test_max_seq_len_to_capture_sends_longer_contexts_to_the_eager_path():
    """vLLM's rule: a decode step whose context is longer than max_seq_len_to_capture runs eagerly, not from a CUDA graph."""
    from loraledger.gpu.cuda_graphs import DecodeGraphs
    from loraledger.scheduling.step_plan import SeqWork

    graphs = DecodeGraphs.__new__(DecodeGraphs)  # the rule alone; building one needs a GPU
    graphs.max_batch, graphs.max_len, graphs.block_size = 8, 64, 16
    graphs.width = 4

    def decode(context: int) -> SeqWork:
        return SeqWork(
            seq_id=0,
            token_ids=[5],
            start_pos=context - 1,
            block_table=list(range(-(-context // 16))),
            lora_slot=-1,
            sample=True,
        )

    assert graphs.accepts([decode(64)])
    assert not graphs.accepts([decode(65)])
    assert not graphs.accepts([decode(10), decode(65)])
