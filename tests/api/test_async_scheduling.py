"""Overlapped scheduling (EngineArgs.async_scheduling): step N+1 planned and launched while step N runs.

Whatever a request asks for, the outputs are those of one step at a time: the same tokens, text,
logprobs and finish reasons. The stop ids and strings below are reached within a few tokens, so
some sequences end on a token the Scheduler learns of only after the next step was launched.
"""

from __future__ import annotations

from unittest import mock

import pytest

from loraledger import LLM, SamplingParams
from loraledger.gpu.model_runner import ModelRunner
from loraledger.scheduling.step_plan import PENDING_TOKEN
from tests.api.conftest import loras_for, random_prompts


def _requests(tiny):
    loras = loras_for(tiny)
    names = [None, "qv_r4", "all_r8", "ogd_r16_rslora", "all_r8", None, "qv_r4", None]
    prompts = random_prompts(len(names), seed=31, lo=4, hi=15)
    params = [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0.9, top_k=30, top_p=0.9, seed=5, max_tokens=10, logprobs=2),
        SamplingParams(
            temperature=1.0, seed=6, max_tokens=9, repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2
        ),
        SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=8, stop_token_ids=list(range(150, 300))),
        SamplingParams(temperature=0, max_tokens=14, min_tokens=6, stop_token_ids=list(range(200, 300))),
        SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1, logprobs=0, stop=["e", "o"]),
        SamplingParams(temperature=1.2, seed=8, max_tokens=16),
        SamplingParams(temperature=0, max_tokens=1),
    ]
    return [{"prompt_token_ids": p} for p in prompts], params, [loras[n] if n else None for n in names]


def _run(tiny, async_scheduling: bool, **engine_kwargs):
    prompts, params, loras = _requests(tiny)
    launched = []  # per plan: (uses a pending token, sequences in it)
    original = ModelRunner.launch

    def spy(runner, plan):
        launched.append((any(w.token_ids and w.token_ids[-1] == PENDING_TOKEN for w in plan.seqs), len(plan.seqs)))
        return original(runner, plan)

    kwargs = dict(enable_lora=True, max_loras=3, max_lora_rank=16, block_size=4, audit_url=None, seed=0)
    with (
        mock.patch.object(ModelRunner, "launch", spy),
        LLM(model=str(tiny.model_dir), async_scheduling=async_scheduling, **(kwargs | engine_kwargs)) as llm,
    ):
        outs = llm.generate(prompts, params, lora_request=loras)
    return outs, sum(ahead for ahead, _ in launched), sum(n for _, n in launched)


def _summary(outs):
    rows = []
    for out in outs:
        for c in out.outputs:
            rows.append((c.index, tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason))
    return rows


def _logprobs(outs):
    values = []
    for out in outs:
        for c in out.outputs:
            values.append(c.cumulative_logprob)
            for step in c.logprobs or []:
                values.extend(sorted(lp.logprob if hasattr(lp, "logprob") else lp for lp in step.values()))
        for pos in out.prompt_logprobs or []:
            if pos is not None:
                values.extend(sorted(lp.logprob if hasattr(lp, "logprob") else lp for lp in pos.values()))
    return values


@pytest.mark.parametrize("kv_blocks", [None, 40], ids=["roomy-cache", "tiny-cache-preempts"])
def test_overlapped_steps_give_the_outputs_of_one_step_at_a_time(tiny_llama, kv_blocks):
    extra = {} if kv_blocks is None else {"num_kv_blocks": kv_blocks}
    sync, sync_ahead, sync_work = _run(tiny_llama, False, **extra)
    overlapped, ahead, work = _run(tiny_llama, True, **extra)
    assert sync_ahead == 0, "one step at a time never plans ahead"
    assert ahead > 5, "the overlapped engine was meant to launch steps before the last one's tokens were back"
    assert _summary(overlapped) == _summary(sync)
    assert _logprobs(overlapped) == pytest.approx(_logprobs(sync), abs=1e-5)
    finishes = [c.finish_reason for o in sync for c in o.outputs]
    assert set(finishes) == {"stop", "length"}, "the workload should end sequences both ways"
    # the price of planning ahead: one sequence-step too many for each sequence a sampled token ended
    # (its next step was on its way), none for a length ending (known in advance), plus recomputes
    if kv_blocks is None:
        assert sync_work <= work <= sync_work + finishes.count("stop")


def test_overlapped_engine_reports_its_steps(tiny_llama):
    with LLM(model=str(tiny_llama.model_dir), audit_url=None, seed=0) as llm:
        llm.generate(
            [{"prompt_token_ids": p} for p in random_prompts(4, seed=32)],
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        )
        stats = llm.llm_engine.get_stats()
    assert stats.steps >= 10
    assert 0 < stats.forward_seconds and 0 < stats.wall_seconds
    assert stats.gpu_seconds == 0.0 and stats.gpu_idle_seconds == 0.0  # device events exist on CUDA only
