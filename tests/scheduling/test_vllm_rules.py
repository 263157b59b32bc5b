"""vLLM rules the scheduling policy carries out: prompts whole without chunked prefill, generation-config EOS ids as
stop ids, per-completion seeds of n > 1, logprobs=-1 as the vocabulary, and the token controls handed to the sampler.

The policy is called directly: the first plans it makes are inspected, and a stand-in executor samples token 9 for
every sequence.
"""

from __future__ import annotations

from loraledger.sampling_params import SamplingParams
from loraledger.scheduling.request_intake import mix_seed
from tests.scheduling.policy_driver import make_policy, new_request, run_step

VOCAB = 512


def _run(requests: list[tuple[str, list[int], SamplingParams]], steps: int, **kwargs):
    """Plans made and SeqUpdates returned in `steps` steps."""
    policy = make_policy(eos_token_ids=(2,), vocab_size=VOCAB, **kwargs)
    for rid, prompt, params in requests:  # all added before the first plan is made
        policy.add(new_request(rid, prompt, params))
    plans, updates = [], []
    for _ in range(steps):
        ran = run_step(policy)
        if ran is None:
            break
        step, result = ran
        plans.append(step.plan)
        updates.extend(result.updates)
    return plans, updates


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_that_holds_all_of_it():
    """vLLM's enable_chunked_prefill=False: prompts are scheduled whole (with it, the third prompt's head shares step 1)."""
    requests = [(f"r{i}", [5] * 60, GREEDY) for i in range(3)]
    chunked, _ = _run(requests, 1)
    assert [len(w.token_ids) for w in chunked[0].seqs] == [60, 60, 8]
    whole, _ = _run(requests, 2, chunked_prefill=False)
    assert [len(w.token_ids) for w in whole[0].seqs] == [60, 60]
    assert sorted(len(w.token_ids) for w in whole[1].seqs) == [1, 1, 60]


def test_generation_config_eos_ids_stop_like_stop_token_ids_unless_ignore_eos():
    """vLLM's update_from_generation_config: the file's EOS ids beyond the model's join stop_token_ids (stop_reason: the id)."""
    _, updates = _run([("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4))], 4, extra_stop_ids=(2, 9))
    assert [(u.token_ids, u.finish_reason, u.stop_reason) for u in updates] == [([9], "stop", 9)]
    _, updates = _run([("r", [5, 6, 7], GREEDY)], 8, extra_stop_ids=(9,))
    assert len(updates) == 4 and updates[-1].finish_reason == "length"


def test_completion_i_of_a_seeded_request_draws_as_a_request_with_seed_plus_i():
    """vLLM's parallel sampling: child i of a request with seed s is sampled with seed s + i."""
    plans, _ = _run(
        [
            ("many", [5, 6, 7], SamplingParams(n=3, temperature=1.0, seed=40, max_tokens=2)),
            *[
                (f"one-{i}", [5, 6, 7], SamplingParams(n=1, temperature=1.0, seed=40 + i, max_tokens=2))
                for i in range(3)
            ],
        ],
        3,  # the siblings of n > 1 start once the first sequence's prompt is in
    )
    seeds = {}
    for plan in plans:
        for new in plan.new_seqs:
            seeds[new.seq_id] = new.sampling.seed
    assert [seeds[i] for i in range(3)] == [seeds[3], seeds[4], seeds[5]] == [mix_seed(40 + i, 0) for i in range(3)]


def test_logprobs_minus_one_asks_for_the_vocabulary_and_token_controls_reach_the_sampler():
    params = SamplingParams(
        temperature=1.0, logprobs=-1, prompt_logprobs=-1, logit_bias={7: 2.5}, allowed_token_ids=[7, 8, 9], max_tokens=2
    )
    plans, _ = _run([("r", [5, 6, 7], params)], 1)
    spec = plans[0].new_seqs[0].sampling
    assert spec.logprobs == VOCAB and spec.prompt_logprobs == VOCAB
    assert (spec.bias_token_ids, spec.bias_values, spec.allowed_token_ids) == ([7], [2.5], [7, 8, 9])
    assert spec.controls_tokens and not spec.needs_history
