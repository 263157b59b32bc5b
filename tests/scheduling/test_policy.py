"""SchedulingPolicy called directly: preemption when KV blocks run out, adapter slots, abort and stop, failures."""

from __future__ import annotations

from loraledger.errors import RequestFailedError, StructuredOutputError
from loraledger.sampling_params import SamplingParams
from loraledger.scheduling.step_plan import SampledToken, StepOutput
from tests.scheduling.policy_driver import Adapter, make_policy, new_request, run_step, sample_all

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
A, B = Adapter("a" * 64, "sql"), Adapter("b" * 64, "chat")


def _run_all(policy, max_steps: int = 200):
    """Steps until the policy has nothing to run: [(plan, StepResult)], and each request's output tokens."""
    steps, tokens = [], {}
    for _ in range(max_steps):
        ran = run_step(policy)
        if ran is None:
            break
        step, result = ran
        steps.append((step, result))
        for u in result.updates:
            tokens.setdefault(u.audit_id, []).extend(u.token_ids)
    return steps, tokens


def test_out_of_kv_blocks_the_youngest_sequence_is_preempted_and_recomputed():
    # 5 blocks of 4 tokens: two 8-token prompts fit, but not both once they grow past their second block
    policy = make_policy(num_kv_blocks=5, block_size=4)
    policy.add(new_request("old", list(range(1, 9)), GREEDY))
    policy.add(new_request("young", list(range(11, 19)), GREEDY))
    steps, tokens = _run_all(policy)
    preempted = [p for _, result in steps for p in result.preempted]
    assert preempted == [("young", 0)]  # once, and never the older request
    (at,) = [i for i, (_, result) in enumerate(steps) if result.preempted]
    step, result = steps[at]
    assert [w.seq_id for w in step.plan.seqs] == [0]  # the step it made room for runs the old request alone
    assert [t.audit_id for t in result.timings if t.preempted] == ["young"]
    # recomputed later from position 0: its prompt and the token it had, then it goes on
    recompute = next(s.plan for s, _ in steps[at + 1 :] if any(w.seq_id == 1 for w in s.plan.seqs))
    work = next(w for w in recompute.seqs if w.seq_id == 1)
    assert work.start_pos == 0 and work.token_ids == list(range(11, 19)) + [9]
    assert tokens == {"old": [9] * 8, "young": [9] * 8}


def test_a_plan_made_ahead_never_preempts():
    policy = make_policy(num_kv_blocks=5, block_size=4)
    policy.add(new_request("old", list(range(1, 9)), GREEDY))
    policy.add(new_request("young", list(range(11, 19)), GREEDY))
    first = policy.schedule()
    assert policy.schedule(ahead=True) is None  # the young sequence needs a block only a preemption frees
    result = policy.update(first, sample_all(first))
    assert result.preempted == [] and len(result.updates) == 2
    after = policy.schedule()
    assert [s.request.audit_id for s in after.preempted] == ["young"]


def test_one_slot_serves_one_adapter_at_a_time_and_the_next_takes_it_over():
    policy = make_policy(max_loras=1)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    policy.add(new_request("a1", [5, 6, 7], params, A))
    policy.add(new_request("b1", [5, 6, 7], params, B))
    policy.add(new_request("a2", [5, 6, 8], params, A))
    policy.add(new_request("base", [5, 6, 9], params))
    steps, tokens = _run_all(policy)
    first = steps[0][0].plan
    assert [(load.slot, load.fingerprint) for load in first.slot_loads] == [(0, A.fingerprint)]
    assert sorted(w.lora_slot for w in first.seqs) == [-1, 0, 0]  # a1, a2 in slot 0, the base model in none
    loads = [(i, load.fingerprint) for i, (s, _) in enumerate(steps) for load in s.plan.slot_loads]
    assert loads == [(0, A.fingerprint), (3, B.fingerprint)]  # B once A's requests are done
    assert all(len(t) == 3 for t in tokens.values()) and len(tokens) == 4
    state = policy.queue_state()
    assert state["slot_loads"] == {"sql": 1, "chat": 1} and state["slot_evictions"] == {"sql": 1}
    assert state["max_loras"] == 1 and state["num_requests_running"] == state["num_requests_waiting"] == 0


def test_a_pinned_adapter_keeps_the_only_slot_until_unpinned():
    policy = make_policy(max_loras=1)
    policy.pin(A.fingerprint, A)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    policy.add(new_request("b1", [5, 6, 7], params, B))
    assert policy.schedule() is None  # B cannot get the slot A holds
    policy.add(new_request("a1", [5, 6, 7], params, A))
    steps, tokens = _run_all(policy)
    assert set(tokens) == {"a1"}
    assert steps[0][0].plan.slot_loads[0].checkpoint is A  # a pinned adapter's checkpoint comes from the pin
    policy.unpin(A.fingerprint)
    _, tokens = _run_all(policy)
    assert tokens == {"b1": [9, 9]}


def test_abort_and_stop_end_sequences_and_the_next_plan_frees_them():
    policy = make_policy()
    policy.add(new_request("r", [5, 6, 7], SamplingParams(n=2, temperature=1.0, max_tokens=8)))
    policy.add(new_request("gone", [5, 6, 8], GREEDY))
    for _ in range(3):
        run_step(policy)
    policy.stop("r", 1)  # a stop string ended r's second sequence
    assert policy.abort(["gone", "unknown"]) == [("gone", 0)]
    assert not policy.has_request("gone") and policy.abort(["gone"]) == []
    step = policy.schedule()
    assert sorted(step.plan.freed_seq_ids) == [1, 2] and [w.seq_id for w in step.plan.seqs] == [0]


def test_a_result_for_a_sequence_aborted_while_its_step_ran_is_dropped():
    policy = make_policy()
    policy.add(new_request("r", [5, 6, 7], GREEDY))
    step = policy.schedule()
    policy.abort(["r"])
    result = policy.update(step, sample_all(step))
    assert result.updates == [] and result.failed == []


def test_a_failed_step_fails_its_requests_and_forgets_the_slots_it_loaded():
    policy = make_policy(max_loras=1)
    policy.add(new_request("r", [5, 6, 7], GREEDY, A))
    step = policy.schedule()
    result = policy.update(step, None, RuntimeError("device lost"))
    [(rid, error)] = result.failed
    assert rid == "r" and isinstance(error, RequestFailedError) and "device lost" in str(error)
    assert not policy.has_request("r") and policy.slots.slot_of(A.fingerprint) is None


def test_a_grammar_that_refuses_every_token_fails_that_request_alone():
    policy = make_policy()
    policy.add(new_request("stuck", [5, 6, 7], GREEDY, caller_request_id="mine"))
    policy.add(new_request("fine", [5, 6, 8], GREEDY))
    step = policy.schedule()
    sampled = [SampledToken(0, 9, 0.0, grammar_refused=True), SampledToken(1, 9, 0.0)]
    result = policy.update(step, StepOutput(step_id=step.plan.step_id, sampled=sampled))
    assert [u.audit_id for u in result.updates] == ["fine"]
    [(rid, error)] = result.failed
    assert rid == "stuck" and isinstance(error, StructuredOutputError)
    assert "'mine' (audit id stuck)" in str(error)
    assert not policy.has_request("stuck") and policy.has_request("fine")
