"""vLLM's in-place adapter reload (LoRARequest(..., load_inplace=True)), as an RL loop uses it: re-train, save under
the same folder and name, reload, generate. Each version matches transformers + PEFT on that version's weights, is
on record under its own fingerprint, and never serves (or shares prefix-cache blocks with) the other's requests."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch

from loraledger import LLM, EngineArgs, LLMEngine, LoRARequest, SamplingParams
from loraledger.audit import AuditLog
from loraledger.lora.checkpoint_reader import fingerprint_adapter
from tests.api.conftest import random_prompts
from tests.model_fixtures import hf_reference_generate

TARGETS = ["q_proj", "v_proj", "down_proj"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def save_policy(tiny, folder: Path, step: int, snapshots: Path) -> Path:
    """One RL step's adapter: new weights saved over `folder` (as a trainer does); returns a copy of this version
    (the reference model needs each version at a path of its own)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1000 + step)
    base = AutoModelForCausalLM.from_pretrained(tiny.model_dir)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False, lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    get_peft_model(copy.deepcopy(base), config).save_pretrained(folder)
    snapshot = snapshots / f"step-{step}"
    shutil.copytree(folder, snapshot)
    return snapshot


def test_rl_loop_reloads_in_place_each_version_matches_peft_and_is_on_record(tiny_llama, tmp_path):
    """vLLM: load_inplace=True reloads the adapter under the same name and id; requests after it use the new
    weights. Ours: each version has its own fingerprint, `adapters` row and bindings."""
    folder, snapshots = tmp_path / "policy", tmp_path / "snapshots"
    snapshots.mkdir()
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    prompts = random_prompts(3, seed=71)
    versions: list[tuple[str, list]] = []  # (fingerprint, outputs) per step
    with LLM(model=str(tiny_llama.model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, audit_url=url) as llm:
        for step in range(3):
            snapshot = save_policy(tiny_llama, folder, step, snapshots)
            ref = hf_reference_generate(
                tiny_llama.model_dir, {"policy": snapshot}, prompts, ["policy"] * len(prompts), 8
            )
            lora = LoRARequest("policy", 1, str(folder), load_inplace=step > 0)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=lora, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == ref.token_ids, (
                f"step {step} does not match PEFT on its weights"
            )
            fp = fingerprint_adapter(str(folder))
            assert {o.metrics.adapter_fingerprint for o in outs} == {fp}
            versions.append((fp, outs))
    fps = [fp for fp, _ in versions]
    assert len(set(fps)) == 3, "every re-trained version is a new fingerprint"
    assert versions[0][1][0].outputs[0].token_ids != versions[1][1][0].outputs[0].token_ids  # the weights did change

    with AuditLog(url) as log:
        assert log.verify().ok
        adapters = {a.record.fingerprint: a.record for a in log.adapters()}
        assert set(fps) <= set(adapters) and {adapters[fp].name for fp in fps} == {"policy"}  # a row per version
        for fp, outs in versions:
            for out in outs:  # which version served which request
                lineage = log.request(out.audit_id)
                assert lineage.binding.adapter_fingerprint == fp
                assert [c.adapter_fingerprint for c in lineage.completions] == [fp]
                assert (lineage.binding.lora_name, lineage.binding.lora_int_id) == ("policy", 1)


def test_a_running_request_finishes_on_its_version_and_shares_no_cached_blocks_with_the_next(tiny_llama, tmp_path):
    """vLLM: an in-place reload replaces the adapter for later requests. Ours: a request admitted before it keeps
    the weights it was bound to until it finishes, and the prefix cache (keyed by fingerprint) shares no block
    between versions."""
    folder, snapshots = tmp_path / "policy", tmp_path / "snapshots"
    snapshots.mkdir()
    prompt = random_prompts(1, seed=72, lo=16, hi=16)[0]  # four full blocks: cacheable
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    v1 = save_policy(tiny_llama, folder, 1, snapshots)
    args = EngineArgs(
        model=str(tiny_llama.model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4, audit_url=None
    )
    engine = LLMEngine.from_engine_args(args)
    finals = {}
    try:
        assert (
            engine.add_request("old", {"prompt_token_ids": prompt}, long, LoRARequest("policy", 1, str(folder)))
            == "old"
        )
        for _ in range(3):  # the old version's request is running
            assert not any(out.finished for out in engine.step())
        v2 = save_policy(tiny_llama, folder, 2, snapshots)
        engine.add_request(
            "new", {"prompt_token_ids": prompt}, long, LoRARequest("policy", 1, str(folder), load_inplace=True)
        )
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        # the control: the same prompt on the same version again does hit the cache
        engine.add_request("again", {"prompt_token_ids": prompt}, long, LoRARequest("policy", 1, str(folder)))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
    finally:
        engine.close()
    ref = hf_reference_generate(
        tiny_llama.model_dir, {"v1": v1, "v2": v2}, [prompt, prompt], ["v1", "v2"], 24, mixed=False
    )
    assert finals["old"].outputs[0].token_ids == ref.token_ids[0], "the running request was switched to the new weights"
    assert finals["new"].outputs[0].token_ids == ref.token_ids[1]
    assert finals["old"].metrics.adapter_fingerprint != finals["new"].metrics.adapter_fingerprint
    assert not finals["new"].num_cached_tokens, "a block of the old version was reused for the new one"
    assert finals["again"].num_cached_tokens and finals["again"].outputs[0].token_ids == ref.token_ids[1]


@pytest.mark.parametrize("inplace", [False, True], ids=["refused", "reloaded"])
def test_a_new_folder_under_a_loaded_id_needs_load_inplace(tiny_llama, tmp_path, inplace):
    """vLLM: without load_inplace an adapter already loaded under an id is not read again. Ours: a different path
    under a loaded id is refused (LoRARequestConflictError) unless the request reloads in place."""
    from loraledger.errors import LoRARequestConflictError

    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    a, b = tmp_path / "a", tmp_path / "b"
    save_policy(tiny_llama, a, 1, snapshots)
    save_policy(tiny_llama, b, 2, snapshots)
    with LLM(model=str(tiny_llama.model_dir), enable_lora=True, max_lora_rank=8, audit_url=None) as llm:
        first = llm.generate("hello", GREEDY, lora_request=LoRARequest("policy", 1, str(a)), use_tqdm=False)[0]
        moved = LoRARequest("policy", 1, str(b), load_inplace=inplace)
        if not inplace:
            with pytest.raises(LoRARequestConflictError, match="load_inplace=True"):
                llm.generate("hello", GREEDY, lora_request=moved, use_tqdm=False)
            return
        second = llm.generate("hello", GREEDY, lora_request=moved, use_tqdm=False)[0]
    assert first.metrics.adapter_fingerprint == fingerprint_adapter(str(a))
    assert second.metrics.adapter_fingerprint == fingerprint_adapter(str(b))


def test_lora_request_takes_vllms_positional_fields_and_is_equal_and_hashed_by_name():
    """vLLM's LoRARequest(lora_name, lora_int_id, lora_path, base_model_name, tensorizer_config_dict, load_inplace);
    its __eq__ and __hash__ use lora_name alone."""
    from loraledger.errors import LoRARequestError

    a = LoRARequest("policy", 1, "/adapters/a", "base-model", None, True)
    assert (a.base_model_name, a.tensorizer_config_dict, a.load_inplace) == ("base-model", None, True)
    assert LoRARequest("policy", 1, "/adapters/a").load_inplace is False
    same_name = LoRARequest("policy", 2, "/adapters/b")
    assert a == same_name and hash(a) == hash(same_name) and len({a, same_name}) == 1
    assert a != LoRARequest("other", 1, "/adapters/a") and a != "policy"
    with pytest.raises(LoRARequestError, match="tensorizer"):
        LoRARequest("policy", 1, "/adapters/a", None, {"tensorizer_uri": "s3://x"})
    with pytest.raises(LoRARequestError, match="load_inplace"):
        LoRARequest("policy", 1, "/adapters/a", load_inplace="yes")


def test_after_an_in_place_reload_the_adapter_is_registered_without_the_reload(tiny_llama, tmp_path):
    """load_inplace asks for one reading of the folder: pinning the adapter afterwards (which resolves it from the
    registry) serves what was loaded and reads nothing again."""
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    a, b = tmp_path / "a", tmp_path / "b"
    save_policy(tiny_llama, a, 1, snapshots)
    save_policy(tiny_llama, b, 2, snapshots)
    with LLM(model=str(tiny_llama.model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, audit_url=None) as llm:
        llm.llm_engine.add_lora(LoRARequest("policy", 1, str(a)))
        llm.llm_engine.add_lora(LoRARequest("policy", 1, str(b), load_inplace=True))
        engine = llm.llm_engine.engine
        loads = llm.llm_engine.call(engine.get_metrics).host_loads["policy"]
        assert loads == 2
        assert llm.llm_engine.call(engine.pin_lora, 1)
        assert llm.llm_engine.call(engine.get_metrics).host_loads["policy"] == loads
        out = llm.generate("hello", GREEDY, lora_request=LoRARequest("policy", 1, str(b)), use_tqdm=False)[0]
        # an RL loop's first step may ask for the reload already: registered, it is the adapter alone too
        llm.llm_engine.add_lora(LoRARequest("first", 2, str(a), load_inplace=True))
        assert llm.llm_engine.call(engine.pin_lora, 2)
        assert llm.llm_engine.call(engine.get_metrics).host_loads["first"] == 1
    assert out.metrics.adapter_fingerprint == fingerprint_adapter(str(b))
