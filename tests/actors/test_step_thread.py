"""StepThread: a step is finished only once the next is launched (or on a flush), results in plan order, failures contained."""

from __future__ import annotations

import threading
import types

import pytest

from loraledger.actors.step_thread import STOP, StepThread
from loraledger.scheduling.step_plan import StepOutput, StepPlan


class FakeRunner:
    """Records the order of launch/finish calls; `fail_launch` / `fail_finish` name steps that raise."""

    def __init__(self, fail_launch=(), fail_finish=()) -> None:
        self.calls: list[tuple[str, int]] = []
        self.fail_launch, self.fail_finish = set(fail_launch), set(fail_finish)
        self.lock = threading.Lock()

    def launch(self, plan: StepPlan):
        with self.lock:
            self.calls.append(("launch", plan.step_id))
        if plan.step_id in self.fail_launch:
            raise RuntimeError(f"launch {plan.step_id}")
        return types.SimpleNamespace(step_id=plan.step_id)

    def finish(self, step) -> StepOutput:
        step_id = step.step_id
        with self.lock:
            self.calls.append(("finish", step_id))
        if step_id in self.fail_finish:
            raise RuntimeError(f"finish {step_id}")
        return StepOutput(step_id=step_id, sampled=[])


def _results(thread: StepThread, count: int) -> list:
    return [thread.results.get(timeout=10) for _ in range(count)]


def test_each_step_is_finished_after_the_next_is_launched_and_a_flush_finishes_the_rest():
    runner = FakeRunner()
    thread = StepThread(lambda: runner)
    assert thread.wait_ready() is runner
    for step_id in (1, 2, 3):
        thread.submit(StepPlan(step_id, seqs=[]))
    done = _results(thread, 2)
    assert [d.step_id for d in done] == [1, 2]
    assert thread.results.empty()  # step 3 waits for a next plan or a flush
    thread.flush()
    assert _results(thread, 1)[0].step_id == 3
    assert runner.calls == [("launch", 1), ("launch", 2), ("finish", 1), ("launch", 3), ("finish", 2), ("finish", 3)]
    assert thread.stop(timeout=10)
    assert thread.results.get(timeout=10) is STOP


def test_a_failing_step_is_reported_in_plan_order_and_the_thread_goes_on():
    runner = FakeRunner(fail_launch={3}, fail_finish={1})
    thread = StepThread(lambda: runner)
    thread.wait_ready()
    for step_id in (1, 2, 3, 4):
        thread.submit(StepPlan(step_id, seqs=[]))
    thread.flush()
    done = _results(thread, 4)
    assert [d.step_id for d in done] == [1, 2, 3, 4]
    assert [d.output is None for d in done] == [True, False, True, False]
    assert str(done[0].error) == "finish 1" and str(done[2].error) == "launch 3"
    assert thread.stop(timeout=10)


def test_a_runner_that_cannot_be_built_is_reported():
    def broken():
        raise OSError("weights missing")

    thread = StepThread(broken)
    with pytest.raises(OSError, match="weights missing"):
        thread.wait_ready()
    assert thread.results.get(timeout=10) is STOP
