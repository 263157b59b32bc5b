"""generation_config: the model folder's generation_config.json as vLLM reads it ("auto"), or not at all ("vllm")."""

from __future__ import annotations

import json
import shutil

import pytest

from loraledger import LLM, SamplingParams
from loraledger import errors as E
from tests.api.conftest import random_prompts
from tests.model_fixtures import hf_reference_generate

PROMPTS = random_prompts(3, seed=90)


@pytest.fixture(scope="module")
def with_config(tiny_llama, tmp_path_factory):
    """tiny_llama's checkpoint with a generation_config.json that sets sampling defaults and a second EOS id:
    the third greedy token of the first prompt (so that it stops that prompt early, and only that one)."""
    plain = hf_reference_generate(
        tiny_llama.model_dir, {}, PROMPTS, [None] * 3, 12, mixed=False, repetition_penalty=1.3
    ).token_ids
    stop_id = plain[0][2]
    assert stop_id not in plain[0][:2] and stop_id != 2
    folder = tmp_path_factory.mktemp("generation-config") / "model"
    shutil.copytree(tiny_llama.model_dir, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(
        do_sample=False, temperature=0.0, repetition_penalty=1.3, max_new_tokens=12, eos_token_id=[2, stop_id]
    )
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder, stop_id


def test_auto_takes_the_default_sampling_params_from_the_file(with_config):
    """vLLM's get_diff_sampling_param: the file's repetition_penalty, temperature, top_k, top_p, min_p and
    max_new_tokens (as max_tokens) are the defaults when sampling_params is None; the outputs are those of
    transformers' generate with the same generation config (greedy, repetition penalty 1.3, the EOS list)."""
    folder, stop_id = with_config
    ref = hf_reference_generate(
        folder, {}, PROMPTS, [None] * 3, 12, mixed=False, repetition_penalty=1.3, eos_token_id=[2, stop_id]
    ).token_ids
    with LLM(model=str(folder), audit_url=None) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.repetition_penalty, defaults.max_tokens) == (0.0, 1.3, 12)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    first = outs[0].outputs[0]
    # vLLM puts the file's extra EOS ids among stop_token_ids: stop_reason is the id, and it leaves the text
    assert first.token_ids[-1] == stop_id and first.finish_reason == "stop" and first.stop_reason == stop_id
    assert len(first.token_ids) == 3


def test_the_files_eos_list_stops_any_request_unless_ignore_eos(with_config):
    folder, stop_id = with_config
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with LLM(model=str(folder), audit_url=None) as llm:
        stopped = llm.generate(
            prompt, SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3), use_tqdm=False
        )[0].outputs[0]
        ignored = llm.generate(
            prompt,
            SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
            use_tqdm=False,
        )[0]
    assert stopped.stop_reason == stop_id and len(stopped.token_ids) == 3
    assert len(ignored.outputs[0].token_ids) == 12 and ignored.outputs[0].token_ids[2] == stop_id


def test_vllm_ignores_the_file(with_config):
    """generation_config="vllm": vLLM's neutral defaults, and the file's EOS list does not stop anything."""
    folder, stop_id = with_config
    with LLM(model=str(folder), generation_config="vllm", audit_url=None) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
        out = llm.generate(
            {"prompt_token_ids": PROMPTS[0]},
            SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3),
            use_tqdm=False,
        )[0]
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].token_ids[2] == stop_id


def test_a_folder_of_its_own_and_a_bad_file(with_config, tiny_llama, tmp_path):
    folder, _ = with_config
    with LLM(model=str(tiny_llama.model_dir), generation_config=str(folder), audit_url=None) as llm:
        assert llm.get_default_sampling_params().max_tokens == 12
    with pytest.raises(E.ModelLoadError, match="neither"):
        LLM(model=str(tiny_llama.model_dir), generation_config=str(tmp_path / "nope"), audit_url=None)
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama.model_dir, bad)
    (bad / "generation_config.json").write_text(json.dumps({"temperature": -3.0, "do_sample": True}))
    with pytest.raises(E.ModelLoadError, match="generation_config"):
        LLM(model=str(bad), audit_url=None)
