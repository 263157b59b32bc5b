"""Work per request is bounded: n (EngineArgs.max_n) and logprobs (max_logprobs), with n at its limit served in full."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from loraledger import LLM, EngineArgs, LLMEngine, SamplingParams
from loraledger import errors as E
from loraledger.store.audit_store import COMPLETIONS, AuditStore
from tests.api.conftest import random_prompts
from tests.model_fixtures import hf_reference_generate

PROMPT = random_prompts(1, seed=43)[0]


def test_max_n_defaults_to_what_one_step_can_run(tiny_llama):
    assert EngineArgs(model="m").resolved_max_n(num_kv_blocks=10_000) == 128
    assert EngineArgs(model="m", max_num_seqs=8).resolved_max_n(num_kv_blocks=10_000) == 8
    assert EngineArgs(model="m").resolved_max_n(num_kv_blocks=20) == 20
    assert EngineArgs(model="m", max_n=3).resolved_max_n(num_kv_blocks=20) == 3
    with pytest.raises(E.ConfigError, match="max_n"):
        EngineArgs(model="m", max_n=0)
    with pytest.raises(E.ConfigError, match="max_num_seqs"):
        EngineArgs(model="m", max_num_seqs="8")


def test_n_at_the_limit_is_served_in_full_and_on_record_and_above_it_is_refused(tiny_llama, tmp_path):
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    ref = hf_reference_generate(tiny_llama.model_dir, {}, [PROMPT], [None], 8, mixed=False).token_ids[0]
    with LLM(model=str(tiny_llama.model_dir), max_num_seqs=8, block_size=4, audit_url=url) as llm:
        limit = llm.llm_engine.engine._core.setup.max_n
        assert limit == 8
        # top_k=1: every completion is the greedy reference (temperature=0 allows n=1 only, as in vLLM)
        out = llm.generate(
            {"prompt_token_ids": PROMPT},
            SamplingParams(n=limit, temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True),
        )[0]
        assert [c.index for c in out.outputs] == list(range(limit))
        assert all(c.token_ids == ref for c in out.outputs)
        with pytest.raises(E.SamplingParamsError, match="max_n=8"):
            llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(n=limit + 1, max_tokens=2))
        with pytest.raises(E.SamplingParamsError, match="max_logprobs=20"):
            llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(logprobs=21, max_tokens=2))
        top = llm.generate(
            {"prompt_token_ids": PROMPT}, SamplingParams(logprobs=20, prompt_logprobs=20, temperature=0, max_tokens=2)
        )[0]
        assert all(len(step) >= 20 for step in top.outputs[0].logprobs)
    with AuditStore(url) as store, store.engine.connect() as conn:
        rows = conn.execute(
            select(func.count()).select_from(COMPLETIONS).where(COMPLETIONS.c.request_id == out.audit_id)
        ).scalar()
    assert rows == limit


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["one-step-at-a-time", "overlapped"])
def test_a_request_at_the_n_limit_does_not_hold_back_a_later_one(tiny_llama, async_scheduling):
    """Counted in the large request's tokens, not in seconds: when the later small request gets its first token,
    the large one (n at its limit, every seat of the batch) has generated only a few more (before: all 60).
    Overlapped, the seat is given up in a step planned once the steps in flight are back."""
    args = EngineArgs(
        model=str(tiny_llama.model_dir), max_num_seqs=4, block_size=4, audit_url=None, async_scheduling=async_scheduling
    )
    engine = LLMEngine(args)
    try:
        big = SamplingParams(
            n=4, temperature=1.0, seed=1, max_tokens=60, ignore_eos=True
        )  # greedy allows n=1 only (vLLM)
        engine.add_request("big", {"prompt_token_ids": PROMPT}, big)
        progress = 0
        while progress < 2:  # the large request is running, its sequences on every seat
            for out in engine.step():
                if out.request_id == "big":
                    progress = max(progress, min(len(c.token_ids) for c in out.outputs) if len(out.outputs) == 4 else 0)
        engine.add_request(
            "small", {"prompt_token_ids": PROMPT[:5]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        )
        at_submit, at_first_token, small_done, big_done = progress, None, False, False
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "big":
                    progress = max(progress, max(len(c.token_ids) for c in out.outputs))
                    big_done |= out.finished
                elif out.outputs[0].token_ids and at_first_token is None:
                    at_first_token = progress
                    small_done |= out.finished
                else:
                    small_done |= out.finished
        assert small_done and big_done
        assert at_first_token is not None and at_first_token - at_submit <= 12, (at_submit, at_first_token)
        final_big = progress
        assert final_big == 60
    finally:
        engine.close()


def _fair_seat_run(tiny, async_scheduling: bool) -> dict[str, list[list[int]]]:
    """The scenario above with seeded draws and a penalty (their positions and histories would show a seat
    given up by a sequence whose step was still in flight), outputs by request."""
    args = EngineArgs(
        model=str(tiny.model_dir), max_num_seqs=4, block_size=4, audit_url=None, async_scheduling=async_scheduling
    )
    engine = LLMEngine(args)
    outputs: dict[str, list[list[int]]] = {}
    try:
        big = SamplingParams(n=4, temperature=0.9, seed=3, repetition_penalty=1.3, max_tokens=24, ignore_eos=True)
        engine.add_request("big", {"prompt_token_ids": PROMPT}, big)
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = [list(c.token_ids) for c in out.outputs]
            steps += 1
            if steps == 3:
                small = SamplingParams(temperature=1.0, seed=4, max_tokens=5, ignore_eos=True)
                engine.add_request("small", {"prompt_token_ids": PROMPT[:5]}, small)
    finally:
        engine.close()
    return outputs


def test_a_fair_seat_given_up_while_steps_are_in_flight_changes_no_output(tiny_llama):
    sync = _fair_seat_run(tiny_llama, False)
    assert len(sync["big"]) == 4 and all(len(t) == 24 for t in sync["big"]) and len(sync["small"][0]) == 5
    assert _fair_seat_run(tiny_llama, True) == sync
