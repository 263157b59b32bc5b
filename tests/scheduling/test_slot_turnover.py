"""The scheduling policy's adapter-slot turnover on the churn-serving traffic, on a simulated clock.

loraledger.scheduling.simulator calls the real SchedulingPolicy with a stand-in executor, so these
checks see the schedule itself: every request finishes, adapters are not thrown out of their slot
and reloaded over and over, and the steps stay near the fewest any schedule could take under
`max_loras` (slot_steps_bound). A second or so per run.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from loraledger.scheduling.simulator import simulate
from tests.scheduling.churn_traffic import Traffic, churn_traffic


@pytest.fixture(scope="module")
def churn_runs():
    rate = 9.8  # the rate of this machine's measured churn-serving run
    base, churn = churn_traffic(rate, 8), churn_traffic(rate, 1000)
    return base, simulate(base, 8), churn, simulate(churn, 8)


def test_every_churn_request_finishes_and_none_starves(churn_runs):
    _, base, traffic, churn = churn_runs
    assert base.completed == churn.completed == len(traffic) == 256
    assert all(math.isfinite(t) for t in churn.ttfts)
    # under overload the queue is long, but no request waits for the whole run: the longest wait
    # stays well inside the time the run takes
    assert max(churn.ttfts) < 0.75 * churn.seconds


def test_churn_schedule_stays_near_the_slot_bound(churn_runs):
    _, _, _, churn = churn_runs
    # measured: 1,569 steps against a bound of 1,242 (1.26x); the live engine took 1,466-1,591
    assert churn.steps_bound == 1242
    assert churn.steps <= 1.35 * churn.steps_bound
    # an adapter keeps its slot while it has work: few are loaded twice (148 loads for 131 adapters)
    assert churn.distinct_adapters == 131
    assert churn.slot_loads <= 1.25 * churn.distinct_adapters


def test_eight_adapters_never_reload_a_slot(churn_runs):
    _, base, _, _ = churn_runs
    assert base.distinct_adapters == 8
    assert base.slot_loads == 8


def test_one_slot_serves_adapters_one_after_another():
    # three adapters, one slot, all requests at t=0: each adapter gets the slot once, runs all of its
    # requests together, and the run takes exactly the bound (sum of each adapter's longest request)
    prompts = [[5] * 8 for _ in range(6)]
    workload = Traffic(
        prompts=prompts, adapter_of=[0, 1, 2, 0, 1, 2], max_tokens=[4, 6, 3, 5, 2, 3], arrivals=[0.0] * 6
    )
    run = simulate(workload, 1)
    assert run.completed == 6
    assert run.slot_loads == 3
    assert run.steps == run.steps_bound == 5 + 6 + 3


def test_base_model_requests_need_no_slot():
    rng = np.random.default_rng(0)
    prompts = rng.integers(4, 100, size=(10, 8)).tolist()
    workload = Traffic(prompts=prompts, adapter_of=[None] * 10, max_tokens=[5] * 10, arrivals=[0.0] * 10)
    run = simulate(workload, 1)
    assert run.completed == 10 and run.slot_loads == 0
    assert run.steps == 5  # all ten share every step
