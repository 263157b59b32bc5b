"""Executor actor: the event loop's side of the StepThread, which owns the ModelRunner (weights, KV cache, adapter slots)."""

from __future__ import annotations

from collections.abc import Callable

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from loraledger.actors.messages import ExecuteStep, FlushSteps
from loraledger.actors.step_thread import STOP, StepThread
from loraledger.logging import get_logger

STOP_TIMEOUT = 60.0  # seconds to let launched steps finish at shutdown before leaving the thread behind


class Executor:
    """Passes plans to the StepThread and its results to the Scheduler, in order.

    The runner is built inside the StepThread (loading weights can take a while), and the actor
    reports ready only once it exists.
    """

    def __init__(
        self, inbox: MemoryObjectReceiveStream, scheduler: MemoryObjectSendStream, make_runner: Callable[[], object]
    ) -> None:
        self._inbox = inbox
        self._scheduler = scheduler
        self._make_runner = make_runner
        self._log = get_logger("executor")

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        steps = StepThread(self._make_runner)
        runner = await anyio.to_thread.run_sync(steps.wait_ready, abandon_on_cancel=True)
        try:
            async with self._inbox, self._scheduler, anyio.create_task_group() as tg:
                tg.start_soon(self._report, steps)
                task_status.started(runner)
                async for msg in self._inbox:
                    match msg:
                        case ExecuteStep(plan=plan, flush=flush):
                            steps.submit(plan)
                            if flush:
                                steps.flush()
                        case FlushSteps():
                            steps.flush()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                stopped = await anyio.to_thread.run_sync(steps.stop, STOP_TIMEOUT)
            if stopped:
                # no step runs now: free the tensors here, on the loop, rather than wherever the runner's
                # last reference happens to go (ModelRunner.close)
                runner.close()
            else:
                self._log.error("the step thread did not stop in time; its runner is left to it", timeout=STOP_TIMEOUT)

    async def _report(self, steps: StepThread) -> None:
        while True:
            done = await anyio.to_thread.run_sync(steps.results.get, abandon_on_cancel=True)
            if done is STOP:
                return
            try:
                await self._scheduler.send(done)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the Scheduler stopped (shutdown) while this step ran: nobody wants it
