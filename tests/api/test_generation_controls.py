"""Sampling and stopping controls: seeds, n > 1, stop strings and token ids, max/min tokens, EOS, streaming kinds, abort."""

from __future__ import annotations

import anyio

from loraledger import AsyncEngine, EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from tests.api.conftest import loras_for, random_prompts


def test_seeded_sampling_is_reproducible_and_batch_independent(llama_llm, tiny_llama):
    loras = loras_for(tiny_llama)
    prompt = {"prompt_token_ids": random_prompts(1, seed=7)[0]}
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llama_llm.generate(prompt, params, lora_request=loras["qv_r4"])[0].outputs[0].token_ids
    again = llama_llm.generate(prompt, params, lora_request=loras["qv_r4"])[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in random_prompts(4, seed=8)]
    batched = llama_llm.generate(
        [*others, prompt],
        [SamplingParams(temperature=1.0, max_tokens=5)] * 4 + [params],
        lora_request=[None, None, loras["all_r8"], None, loras["qv_r4"]],
    )
    assert alone == again == batched[-1].outputs[0].token_ids
    different_seed = llama_llm.generate(
        prompt,
        SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=12, ignore_eos=True),
        lora_request=loras["qv_r4"],
    )
    assert different_seed[0].outputs[0].token_ids != alone


def test_n_completions_each_attributed_to_the_adapter(llama_llm, tiny_llama):
    lora = loras_for(tiny_llama)["all_r8"]
    out = llama_llm.generate(
        {"prompt_token_ids": random_prompts(1, seed=9, lo=9, hi=9)[0]},
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True),
        lora_request=lora,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.lora_request == lora for c in out.outputs) and out.lora_request == lora
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "independent samples should differ"


def test_max_tokens_and_min_tokens_and_eos(llama_llm, tiny_llama):
    prompt = {"prompt_token_ids": random_prompts(1, seed=10)[0]}
    out = llama_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    # make a token "EOS" by asking to stop on it: the first greedy token not seen before it
    k = next(i for i in range(1, 12) if out.token_ids[i] not in out.token_ids[:i])
    target = out.token_ids[k]
    stopped = llama_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[target]))[
        0
    ].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == target
    assert stopped.token_ids == out.token_ids[: k + 1]
    # min_tokens forbids stopping (the stop token cannot be sampled) before min_tokens outputs
    held = llama_llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=k + 2, stop_token_ids=[target])
    )[0].outputs[0]
    assert len(held.token_ids) >= k + 2 and target not in held.token_ids[: k + 1]


def test_stop_strings(llama_llm, tiny_llama):
    prompt = {"prompt_token_ids": random_prompts(1, seed=11)[0]}
    full = llama_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = llama_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))[
        0
    ].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    kept = llama_llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


async def test_streaming_kinds(tiny_llama):
    lora = loras_for(tiny_llama)["qv_r4"]
    prompt = {"prompt_token_ids": random_prompts(1, seed=12)[0]}
    args = EngineArgs(model=str(tiny_llama.model_dir), enable_lora=True, max_loras=2, max_lora_rank=16, audit_url=None)
    async with AsyncEngine.from_engine_args(args) as engine:
        chunks = {}
        for kind in RequestOutputKind:
            params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=kind, logprobs=1)
            chunks[kind] = [out async for out in engine.generate(prompt, params, lora_request=lora)]
    final = chunks[RequestOutputKind.CUMULATIVE][-1]
    assert final.finished and len(final.outputs[0].token_ids) == 10
    assert (
        len(chunks[RequestOutputKind.FINAL_ONLY]) == 1
        and chunks[RequestOutputKind.FINAL_ONLY][0].outputs[0].text == final.outputs[0].text
    )
    delta = chunks[RequestOutputKind.DELTA]
    assert len(delta) > 1 and all(c.lora_request == lora and c.outputs[0].lora_request == lora for c in delta)
    assert "".join(c.outputs[0].text for c in delta) == final.outputs[0].text
    assert sum((c.outputs[0].token_ids for c in delta), []) == final.outputs[0].token_ids
    merged = delta[0]
    for c in delta[1:]:
        merged.add(c, aggregate=True)
    assert merged.outputs[0].token_ids == final.outputs[0].token_ids and merged.finished
    cumulative = chunks[RequestOutputKind.CUMULATIVE]
    assert all(len(a.outputs[0].token_ids) < len(b.outputs[0].token_ids) for a, b in zip(cumulative, cumulative[1:]))


def test_llm_engine_step_loop_with_late_requests_and_abort(tiny_llama):
    loras = loras_for(tiny_llama)
    args = EngineArgs(model=str(tiny_llama.model_dir), enable_lora=True, max_loras=2, max_lora_rank=16, audit_url=None)
    engine = LLMEngine.from_engine_args(args)
    try:
        prompts = random_prompts(4, seed=13)
        reference = {}
        for i, p in enumerate(prompts):
            engine.add_request(
                f"ref-{i}",
                {"prompt_token_ids": p},
                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                loras["all_r8"] if i % 2 else None,
            )
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    reference[out.request_id] = out.outputs[0].token_ids

        engine.add_request(
            "a-0", {"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        )
        engine.add_request(
            "victim", {"prompt_token_ids": prompts[2]}, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        )
        finished, added, aborted = {}, False, False
        steps = 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            steps += 1
            if not added:  # join while the others are running
                for i in (1, 3):
                    engine.add_request(
                        f"a-{i}",
                        {"prompt_token_ids": prompts[i]},
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        loras["all_r8"],
                    )
                added = True
            elif not aborted:
                engine.abort_request("victim")
                aborted = True
            for out in outs:
                if out.finished:
                    finished[out.request_id] = out
        assert finished["a-0"].outputs[0].token_ids == reference["ref-0"]
        assert finished["a-1"].outputs[0].token_ids == reference["ref-1"]
        assert finished["a-3"].outputs[0].token_ids == reference["ref-3"]
        # vLLM's LLMEngine: an aborted request leaves at once, and step() returns nothing more of it
        assert "victim" not in finished
    finally:
        engine.close()


async def test_abandoned_stream_aborts_and_engine_keeps_serving(tiny_llama):
    args = EngineArgs(model=str(tiny_llama.model_dir), audit_url=None)
    prompt = {"prompt_token_ids": random_prompts(1, seed=14)[0]}
    async with AsyncEngine.from_engine_args(args) as engine:
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        seen = 0
        async for _ in engine.generate(prompt, params, "leaver"):
            seen += 1
            if seen == 3:
                break
        with anyio.fail_after(30):
            outs = [
                o
                async for o in engine.generate(
                    prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "stayer"
                )
            ]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
