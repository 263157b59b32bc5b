"""The policy shares the running batch between requests: a request with a large n does not hold back later ones.

The SchedulingPolicy is called directly with a stand-in executor that samples a token for every sequence that
asks for one, one step at a time, and requests arrive at given step numbers. Everything is counted in steps, so
the assertions do not depend on timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from loraledger.sampling_params import SamplingParams
from loraledger.scheduling import fair_seats
from loraledger.scheduling.request_state import SchedRequest, Seq
from loraledger.scheduling.step_plan import SamplingSpec
from tests.scheduling.policy_driver import make_policy, new_request, run_step


@dataclass
class Arrival:
    step: int  # added before this step is scheduled
    request_id: str
    n: int
    max_tokens: int
    prompt_len: int = 6


@dataclass
class Run:
    steps: int = 0
    first_token: dict[str, int] = field(default_factory=dict)  # request id -> step of its first token (any sequence)
    finished: dict[str, int] = field(default_factory=dict)  # request id -> step its last sequence finished
    tokens: dict[tuple[str, int], int] = field(default_factory=dict)  # (request id, seq index) -> tokens generated
    preempted: dict[str, int] = field(default_factory=dict)  # request id -> preemptions reported
    max_running: int = 0


def run(arrivals: list[Arrival], *, max_num_seqs: int, max_steps: int = 2000, num_kv_blocks: int = 4096) -> Run:
    policy = make_policy(
        num_kv_blocks=num_kv_blocks,
        enable_prefix_caching=True,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        max_model_len=512,
    )
    result = Run()
    step = 0
    pending = sorted(arrivals, key=lambda a: a.step)
    while step < max_steps:
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            params = SamplingParams(n=a.n, max_tokens=a.max_tokens, ignore_eos=True, temperature=1.0, seed=0)
            policy.add(new_request(a.request_id, [7] * a.prompt_len, params))  # greedy allows n=1 only
        ran = run_step(policy)
        if ran is None:
            if not pending:
                break
            step = pending[0].step  # idle until the next arrival
            continue
        scheduled, out = ran
        step += 1
        result.max_running = max(result.max_running, len(scheduled.plan.seqs))
        for timing in out.timings:
            if timing.preempted:
                result.preempted[timing.audit_id] = result.preempted.get(timing.audit_id, 0) + 1
        for u in out.updates:
            if u.token_ids:
                result.first_token.setdefault(u.audit_id, step)
                key = (u.audit_id, u.seq_index)
                result.tokens[key] = result.tokens.get(key, 0) + len(u.token_ids)
            if u.finish_reason is not None:
                result.finished[u.audit_id] = step
    result.steps = step
    return result


def test_a_request_at_the_n_limit_does_not_hold_back_a_later_small_one():
    # n = max_num_seqs: the large request fills every seat, then a small request arrives
    big = Arrival(step=0, request_id="big", n=8, max_tokens=60)
    small = Arrival(step=5, request_id="small", n=1, max_tokens=3)
    r = run([big, small], max_num_seqs=8)
    assert r.first_token["big"] <= 2
    # the small request gets a seat at once (one of big's sequences yields it), not after big's 60 steps
    assert r.first_token["small"] - small.step <= 2, r.first_token
    assert r.finished["small"] - small.step <= 5
    assert r.preempted.get("big", 0) >= 1 and "small" not in r.preempted
    # the large request still gets every token of every sequence
    assert all(r.tokens[("big", i)] == 60 for i in range(8))
    assert r.max_running <= 8


def test_later_requests_are_not_queued_behind_a_large_n_that_is_still_waiting():
    # n is twice the batch: half of the large request's sequences are still waiting when the others arrive
    arrivals = [Arrival(step=0, request_id="big", n=16, max_tokens=40)]
    arrivals += [Arrival(step=3, request_id=f"small-{i}", n=1, max_tokens=4) for i in range(3)]
    r = run(arrivals, max_num_seqs=8)
    for i in range(3):
        assert r.first_token[f"small-{i}"] - 3 <= 2, r.first_token
        assert r.finished[f"small-{i}"] - 3 <= 6
    assert all(r.tokens[("big", i)] == 40 for i in range(16))


def test_two_large_requests_share_the_batch_and_a_third_gets_in():
    arrivals = [
        Arrival(step=0, request_id="a", n=8, max_tokens=50),
        Arrival(step=1, request_id="b", n=8, max_tokens=50),
        Arrival(step=4, request_id="c", n=1, max_tokens=2),
    ]
    r = run(arrivals, max_num_seqs=8)
    assert r.first_token["b"] - 1 <= 2, "b waited for all of a's sequences"
    assert r.first_token["c"] - 4 <= 2
    for rid in ("a", "b"):
        assert all(r.tokens[(rid, i)] == 50 for i in range(8))


@pytest.mark.parametrize("max_num_seqs", [3, 8])
def test_one_sequence_per_request_is_plain_first_come_first_served(max_num_seqs):
    # nobody holds more than a share: no sequence is ever preempted for fairness, and requests start in order
    arrivals = [Arrival(step=0, request_id=f"r{i:02d}", n=1, max_tokens=5 + i % 3) for i in range(20)]
    r = run(arrivals, max_num_seqs=max_num_seqs)
    assert r.preempted == {}
    starts = [r.first_token[f"r{i:02d}"] for i in range(20)]
    assert starts == sorted(starts)
    assert len(r.finished) == 20


# --- the rules themselves, on hand-made queues -------------------------------------------------


def _request(audit_id: str, order: int, n: int, fingerprint: str = "") -> SchedRequest:
    req = SchedRequest(
        audit_id=audit_id,
        order=order,
        params=SamplingParams(n=n, temperature=1.0),
        lora_request=None,
        checkpoint=None,
        adapter_fingerprint=fingerprint,
        prompt_len=3,
        max_output=4,
        stop_ids=frozenset(),
        eos_ids=frozenset(),
    )
    req.seqs = [
        Seq(seq_id=order * 100 + i, index=i, request=req, token_ids=[5, 6, 7], spec=SamplingSpec()) for i in range(n)
    ]
    return req


def test_fair_share_is_an_equal_part_of_the_seats_and_at_least_one():
    assert fair_seats.fair_share(8, 3) == 2
    assert fair_seats.fair_share(8, 0) == 8
    assert fair_seats.fair_share(2, 5) == 1


def test_round_robin_takes_one_sequence_per_request_at_a_time():
    a, b, c = _request("a", 0, 3), _request("b", 1, 2), _request("c", 2, 1)
    waiting = [*a.seqs, *b.seqs, *c.seqs]
    order = [(s.request.audit_id, s.index) for s in fair_seats.round_robin(waiting)]
    assert order == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("a", 2)]


def test_a_full_batch_gives_the_youngest_seat_of_the_richest_request_to_a_seatless_one():
    big, other, small = _request("big", 0, 3), _request("other", 1, 1), _request("small", 2, 1)
    running = [*big.seqs, *other.seqs]  # 4 seats, all taken; share = 4 // 3 = 1
    victims = fair_seats.seat_victims(running, small.seqs, 4, 1, lambda req: True)
    assert victims == [big.seqs[2]]
    # two seatless requests: two seats change hands, both from the request above its share
    late = _request("late", 3, 1)
    victims = fair_seats.seat_victims(running, [*small.seqs, *late.seqs], 4, 1, lambda req: True)
    assert victims == [big.seqs[2], big.seqs[1]]


def test_no_seat_is_taken_while_seats_are_free_nobody_is_above_share_or_the_waiting_cannot_run():
    big, small = _request("big", 0, 3), _request("small", 1, 1)
    assert fair_seats.seat_victims(big.seqs, small.seqs, 4, 2, lambda req: True) == []  # a seat is free
    assert fair_seats.seat_victims(big.seqs, small.seqs, 3, 3, lambda req: True) == []  # big holds only its share
    assert fair_seats.seat_victims(big.seqs, small.seqs, 3, 1, lambda req: False) == []  # small has no slot now
    assert fair_seats.seat_victims(big.seqs, [], 3, 1, lambda req: True) == []
