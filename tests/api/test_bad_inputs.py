"""What a caller sends fails only that caller's request, with a typed error naming the problem, through every entry point.

Each case reproduces a bad input that used to stop the engine for everyone (or to raise a bare
TypeError, or to be accepted); after each, the same engine serves a good request with the output it
gave before.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time

import anyio
import pytest

from loraledger import LLM, AsyncEngine, EngineArgs, LoRARequest, SamplingParams
from loraledger import errors as E
from tests.api.conftest import random_prompts

PROMPT = {"prompt_token_ids": random_prompts(1, seed=40)[0]}
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def _mutated(**changes) -> SamplingParams:
    """A SamplingParams that was valid when built and changed afterwards (plain attributes, as in vLLM)."""
    params = SamplingParams(temperature=0, max_tokens=4)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(
        model=str(tiny_llama.model_dir),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        block_size=4,
        audit_url=None,
        seed=0,
    ) as llm:
        yield llm


@pytest.fixture(scope="module")
def expected(llm):
    return llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids


# (what, call arguments as (prompt, params, lora, request id, tenant), the typed error, words of its message)
CASES = [
    (
        "lone surrogate in the prompt",
        ("ab\ud800cd", None, None, None, None),
        E.PromptError,
        ["lone surrogate", "U+D800"],
    ),
    (
        "lone surrogate in a stop string",
        (PROMPT, _mutated(stop=["x\udfff"]), None, None, None),
        E.SamplingParamsError,
        ["stop", "lone surrogate"],
    ),
    (
        "lone surrogate in the request id",
        (PROMPT, None, None, "id-\ud800", None),
        E.RequestIdError,
        ["request id", "lone surrogate"],
    ),
    ("NUL in the request id", (PROMPT, None, None, "id\x00x", None), E.RequestIdError, ["request id", "NUL"]),
    ("a request id that is not a str", (PROMPT, None, None, 17, None), E.RequestIdError, ["request id", "str"]),
    (
        "lone surrogate in the tenant",
        (PROMPT, None, None, None, "acme\ud800"),
        E.TenantError,
        ["tenant", "lone surrogate"],
    ),
    ("tenant=5", (PROMPT, None, None, None, 5), E.TenantError, ["tenant", "str", "int"]),
    (
        "'prompt': 123 beside token ids",
        ({"prompt_token_ids": [5, 6], "prompt": 123}, None, None, None, None),
        E.PromptError,
        ["'prompt'", "int"],
    ),
    ("a prompt of a wrong type", (3.5, None, None, None, None), E.PromptError, ["prompt", "float"]),
    (
        "token ids that are not ints",
        ({"prompt_token_ids": [5, "6"]}, None, None, None, None),
        E.PromptError,
        ["token ids"],
    ),
    ("a bool token id", ({"prompt_token_ids": [5, True]}, None, None, None, None), E.PromptError, ["token ids"]),
    (
        "params as a dict",
        (PROMPT, {"max_tokens": 3}, None, None, None),
        E.SamplingParamsError,
        ["SamplingParams", "dict"],
    ),
    ("lora_request as a str", (PROMPT, None, "qv_r4", None, None), E.LoRARequestError, ["LoRARequest", "str"]),
    (
        "top_p=nan set after construction",
        (PROMPT, _mutated(top_p=math.nan), None, None, None),
        E.SamplingParamsError,
        ["top_p", "nan"],
    ),
    (
        "top_k='x' set after construction",
        (PROMPT, _mutated(top_k="x"), None, None, None),
        E.SamplingParamsError,
        ["top_k"],
    ),
    ("n=0 set after construction", (PROMPT, _mutated(n=0), None, None, None), E.SamplingParamsError, ["n must"]),
    (
        "temperature=-1 set after construction",
        (PROMPT, _mutated(temperature=-1), None, None, None),
        E.SamplingParamsError,
        ["temperature"],
    ),
    (
        "max_tokens=-5 set after construction",
        (PROMPT, _mutated(max_tokens=-5), None, None, None),
        E.SamplingParamsError,
        ["max_tokens"],
    ),
    (
        "temperature=inf",
        (PROMPT, _mutated(temperature=math.inf), None, None, None),
        E.SamplingParamsError,
        ["temperature"],
    ),
    ("a seed beyond 64 bits", (PROMPT, _mutated(seed=1 << 80), None, None, None), E.SamplingParamsError, ["seed"]),
    ("ignore_eos='yes'", (PROMPT, _mutated(ignore_eos="yes"), None, None, None), E.SamplingParamsError, ["ignore_eos"]),
    ("output_kind=7", (PROMPT, _mutated(output_kind=7), None, None, None), E.SamplingParamsError, ["output_kind"]),
    (
        "n above max_n",
        (PROMPT, _mutated(n=10_000, temperature=1.0), None, None, None),
        E.SamplingParamsError,
        ["max_n"],
    ),
    (
        "logprobs above max_logprobs",
        (PROMPT, _mutated(logprobs=1000), None, None, None),
        E.SamplingParamsError,
        ["max_logprobs"],
    ),
    # vLLM's rules for the parameters vLLM code sends
    (
        "greedy with n=2 (vLLM: n must be 1 when greedy)",
        (PROMPT, _mutated(n=2), None, None, None),
        E.SamplingParamsError,
        ["greedy", "n must be 1"],
    ),
    (
        "logprobs=-1 (the vocabulary) above max_logprobs",
        (PROMPT, _mutated(logprobs=-1), None, None, None),
        E.SamplingParamsError,
        ["max_logprobs"],
    ),
    (
        "a stop token id outside the vocabulary",
        (PROMPT, _mutated(stop_token_ids=[5, 10**6]), None, None, None),
        E.SamplingParamsError,
        ["stop_token_ids", "vocabulary"],
    ),
    (
        "a logit_bias key outside the vocabulary",
        (PROMPT, _mutated(logit_bias={10**6: 1.0}), None, None, None),
        E.SamplingParamsError,
        ["logit_bias", "vocabulary"],
    ),
    (
        "logit_bias with a nan",
        (PROMPT, _mutated(logit_bias={5: math.nan}), None, None, None),
        E.SamplingParamsError,
        ["logit_bias", "finite"],
    ),
    (
        "allowed_token_ids empty",
        (PROMPT, _mutated(allowed_token_ids=[]), None, None, None),
        E.SamplingParamsError,
        ["allowed_token_ids"],
    ),
    (
        "an allowed token id outside the vocabulary",
        (PROMPT, _mutated(allowed_token_ids=[4, 512]), None, None, None),
        E.SamplingParamsError,
        ["allowed_token_ids", "vocabulary"],
    ),
    ("bad_words as a str", (PROMPT, _mutated(bad_words="fox"), None, None, None), E.SamplingParamsError, ["bad_words"]),
    (
        "truncate_prompt_tokens above max_model_len",
        (PROMPT, _mutated(truncate_prompt_tokens=10**6), None, None, None),
        E.SamplingParamsError,
        ["truncate_prompt_tokens", "max_model_len"],
    ),
    (
        "truncate_prompt_tokens=0",
        (PROMPT, _mutated(truncate_prompt_tokens=0), None, None, None),
        E.SamplingParamsError,
        ["truncate_prompt_tokens"],
    ),
    (
        "extra_args holding an object",
        (PROMPT, _mutated(extra_args={"a": object()}), None, None, None),
        E.SamplingParamsError,
        ["extra_args", "JSON"],
    ),
    (
        "stop strings with detokenize=False (vLLM: stop needs detokenize)",
        (PROMPT, _mutated(stop=["x"], detokenize=False), None, None, None),
        E.SamplingParamsError,
        ["detokenize"],
    ),
]


ENTRIES = ["LLM.generate", "LLMEngine.add_request", "AsyncEngine.generate"]
# LLM.generate returns final outputs only: it sets output_kind itself, so the output_kind cases are not its to refuse
ENTRY_CASES = [
    pytest.param(entry, *case, id=f"{entry}-{case[0]}")
    for case in CASES
    for entry in ENTRIES
    if not (entry == "LLM.generate" and case[0].startswith("output_kind"))
]


@pytest.mark.parametrize("entry, what, args, error, words", ENTRY_CASES)
def test_a_bad_input_fails_its_request_only(llm, expected, entry, what, args, error, words):
    prompt, params, lora, rid, tenant = args
    with pytest.raises(error) as info:
        _call(llm, entry, prompt, params, lora, rid, tenant)
    assert isinstance(info.value, E.LoraLedgerError)
    for word in words:
        assert word in str(info.value), str(info.value)
    assert llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == expected


def _call(llm, entry, prompt, params, lora, rid, tenant):
    params = GREEDY if params is None else params
    engine = llm.llm_engine
    if entry == "LLM.generate":
        if rid is not None:
            # LLM.generate makes its ids; an id the caller gives goes through add_request
            return _call(llm, "LLMEngine.add_request", prompt, params, lora, rid, tenant)
        return llm.generate(prompt, params, lora_request=lora, tenant=tenant)
    rid = rid if rid is not None else engine.engine.new_request_id()
    if entry == "LLMEngine.add_request":
        engine.add_request(rid, prompt, params, lora, tenant=tenant)
        while engine.has_unfinished_requests():
            engine.step()
        return None

    async def run():
        async for _ in engine.engine.generate(prompt, params, rid, lora, tenant=tenant):
            pass

    return engine.call(run)


def test_a_params_object_changed_after_submission_changes_nothing(llm):
    """The engine keeps a frozen copy made at the API edge: the caller's object is theirs to change."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    engine.add_request("frozen-copy", PROMPT, params)
    params.max_tokens, params.n, params.stop, params.top_p = 1, 3, ["a"], math.nan
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    final = [o for o in outs if o.finished][-1]
    assert len(final.outputs) == 1 and len(final.outputs[0].token_ids) == 7


def test_construction_checks_the_same_rules():
    for kwargs, word in [
        ({"stop": ["\ud800"]}, "stop"),
        ({"seed": 1 << 70}, "seed"),
        ({"top_k": 2.0}, "top_k"),
        ({"skip_special_tokens": None}, "skip_special"),
    ]:
        with pytest.raises(E.SamplingParamsError, match=word):
            SamplingParams(**kwargs)
    for args, word in [
        (("x\ud800", 1, "/a"), "lora_name"),
        (("x", 1, "/a\x00b"), "lora_path"),
        (("x", 1 << 63, "/a"), "lora_int_id"),
    ]:
        with pytest.raises(E.LoRARequestError, match=word):
            LoRARequest(*args)


def test_call_shapes(llm, expected):
    for call, error in [
        (lambda: llm.generate([PROMPT, PROMPT], [GREEDY]), E.SamplingParamsError),
        (lambda: llm.generate([PROMPT], ["not params"]), E.SamplingParamsError),
        (lambda: llm.generate([PROMPT], GREEDY, lora_request=["qv_r4"]), E.LoRARequestError),
        (lambda: llm.generate(12345, GREEDY), E.PromptError),
        (lambda: llm.generate(b"bytes", GREEDY), E.PromptError),
        (lambda: llm.llm_engine.add_request("x", PROMPT, GREEDY, arrival_time=math.nan), E.ConfigError),
        (lambda: llm.llm_engine.abort_request(5), E.RequestIdError),
        (lambda: llm.add_lora("qv_r4"), E.LoRARequestError),
        (lambda: llm.remove_lora("1"), E.LoRARequestError),
    ]:
        with pytest.raises(error):
            call()
    llm.llm_engine.abort_request(["never-submitted"])  # unknown ids are ignored
    assert llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == expected


def test_a_64_gib_sparse_adapter_is_refused_at_once(llm, expected, tiny_llama, tmp_path):
    folder = tmp_path / "huge"
    shutil.copytree(tiny_llama.adapters["qv_r4"], folder)
    os.truncate(folder / "adapter_model.safetensors", 64 << 30)
    lora = LoRARequest("huge", 90, str(folder))
    started = time.perf_counter()
    with pytest.raises(E.AdapterFormatError, match="after the last tensor"):
        llm.generate(PROMPT, GREEDY, lora_request=lora)
    assert time.perf_counter() - started < 30  # an upper bound for a loaded machine: it reads one header
    assert llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == expected


def test_a_duplicate_id_is_raised_as_itself_from_async_with(tiny_llama, tmp_path):
    """Errors a caller can act on come out of `async with AsyncEngine` as themselves, not in an ExceptionGroup."""
    args = EngineArgs(model=str(tiny_llama.model_dir), block_size=4, audit_url=f"sqlite:///{tmp_path / 'audit.db'}")

    async def reuse_a_live_id() -> None:
        async with AsyncEngine.from_engine_args(args) as engine:
            stream = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), "req-1")
            await anext(stream)
            try:
                await engine.submit("req-1", PROMPT, GREEDY)  # vLLM: one id, two unfinished requests
            finally:
                await stream.aclose()

    with pytest.raises(E.DuplicateRequestError, match="'req-1'"):
        anyio.run(reuse_a_live_id)

    async def raise_in_body():
        async with AsyncEngine.from_engine_args(args):
            raise KeyError("the caller's own")

    with pytest.raises(KeyError, match="the caller's own"):
        anyio.run(raise_in_body)


def test_oversized_and_corrupt_adapter_configs(llm, expected, tiny_llama, tmp_path):
    big = tmp_path / "big-config"
    shutil.copytree(tiny_llama.adapters["qv_r4"], big)
    cfg = json.loads((big / "adapter_config.json").read_text())
    cfg["padding"] = "x" * (2 << 20)
    (big / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(E.AdapterFormatError, match="larger than"):
        llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("big-config", 91, str(big)))
    assert llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == expected
