"""Executor actor, driven through its inbox over a recording runner: plans reach the StepThread in order, each
StepDone reaches the Scheduler, a flush finishes what is launched, the runner is closed once the thread stopped, and
a runner that cannot be built ends the actor with its error."""

from __future__ import annotations

import anyio
import pytest

from loraledger.actors.executor import Executor
from loraledger.actors.messages import ExecuteStep, FlushSteps, StepDone
from tests.actors.test_step_thread import FakeRunner, StepPlan

pytestmark = pytest.mark.anyio


class ClosingRunner(FakeRunner):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.closed = False

    def close(self) -> None:
        self.closed = True


async def steps_done(scheduler_rx, count: int) -> list[StepDone]:
    with anyio.fail_after(10):
        return [await scheduler_rx.receive() for _ in range(count)]


async def test_plans_run_in_order_and_each_result_reaches_the_scheduler():
    runner = ClosingRunner(fail_finish={2})
    inbox_tx, inbox_rx = anyio.create_memory_object_stream(8)
    scheduler_tx, scheduler_rx = anyio.create_memory_object_stream(8)
    async with anyio.create_task_group() as tg:
        started = await tg.start(Executor(inbox_rx, scheduler_tx, lambda: runner).run)
        assert started is runner, "ready only once the runner exists, and it is handed back"
        await inbox_tx.send(ExecuteStep(plan=StepPlan(1, seqs=[])))
        await inbox_tx.send(ExecuteStep(plan=StepPlan(2, seqs=[])))
        first = await steps_done(scheduler_rx, 1)  # step 1 is finished once step 2 is launched
        with anyio.move_on_after(0.2):
            early = await scheduler_rx.receive()
            pytest.fail(f"step 2 finished before a flush or a next plan: {early}")
        await inbox_tx.send(FlushSteps())
        second = await steps_done(scheduler_rx, 1)
        await inbox_tx.send(ExecuteStep(plan=StepPlan(3, seqs=[]), flush=True))
        third = await steps_done(scheduler_rx, 1)
        await inbox_tx.aclose()
    done = first + second + third
    assert [d.step_id for d in done] == [1, 2, 3]
    assert [d.output is None for d in done] == [False, True, False]
    assert str(done[1].error) == "finish 2", "a failing step is reported, and the executor goes on"
    assert [c for c in runner.calls if c[0] == "launch"] == [("launch", 1), ("launch", 2), ("launch", 3)]
    assert runner.closed, "the runner is closed once the step thread stopped"


async def test_a_runner_that_cannot_be_built_ends_the_executor_with_its_error():
    def broken():
        raise OSError("weights missing")

    _, inbox_rx = anyio.create_memory_object_stream(1)
    scheduler_tx, _ = anyio.create_memory_object_stream(1)
    with anyio.fail_after(10), pytest.raises(OSError, match="weights missing"):
        await Executor(inbox_rx, scheduler_tx, broken).run()
