"""Executor actor: owns the ModelRunner (weights, KV cache, adapter slots) and runs each step in a worker thread."""

from __future__ import annotations

from typing import Callable

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from loraledger.actors.messages import ExecuteStep, StepDone
from loraledger.logging import get_logger


class Executor:
    """The forward pass runs off the event loop so admission, detokenization and auditing keep going meanwhile.

    The runner is built inside the worker thread too (loading weights can take a while), and the
    actor reports ready only once it exists.
    """

    def __init__(self, inbox: MemoryObjectReceiveStream, scheduler: MemoryObjectSendStream, make_runner: Callable[[], object]) -> None:
        self._inbox = inbox
        self._scheduler = scheduler
        self._make_runner = make_runner
        self._limiter = anyio.CapacityLimiter(1)  # one step at a time, on a thread of its own
        self._log = get_logger("executor")

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        runner = await anyio.to_thread.run_sync(self._make_runner, limiter=self._limiter)
        try:
            await self._serve(runner, task_status)
        finally:
            # no step runs now (a step's worker call is not abandoned on cancel): free the tensors here,
            # on the loop, rather than wherever the runner's last reference happens to go (ModelRunner.close)
            runner.close()

    async def _serve(self, runner, task_status: TaskStatus) -> None:
        async with self._inbox, self._scheduler:
            task_status.started(runner)
            async for msg in self._inbox:
                match msg:
                    case ExecuteStep(plan=plan):
                        try:
                            output = await anyio.to_thread.run_sync(runner.execute, plan, limiter=self._limiter)
                        except Exception as exc:  # a failing step fails its requests, not the engine
                            self._log.exception("step raised", step_id=plan.step_id)
                            done = StepDone(output=None, error=exc, step_id=plan.step_id)
                        else:
                            done = StepDone(output=output, step_id=plan.step_id)
                        try:
                            await self._scheduler.send(done)
                        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                            return  # the Scheduler stopped (shutdown) while this step ran: nobody wants it
