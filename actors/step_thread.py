"""StepThread: the thread that owns the ModelRunner and keeps the device busy from one step to the next.

Plans come in through a thread-safe queue. Each is launched as soon as it arrives (its work queued
on the device), and only then is the step before it finished (its sampled ids read back and
reported): while step N's results travel to the Scheduler and step N+2 is planned, step N+1 is
already running. The event loop is not on that path: it sees a step only when its results are
posted, and its own delays show on the device only if they outlast a whole step.

Results leave through a second queue, in launch order; a FlushSteps (or stop) finishes whatever
is launched without waiting for another plan.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable

from loraledger.actors.messages import StepDone
from loraledger.logging import get_logger
from loraledger.scheduling.step_plan import StepPlan

FLUSH = object()  # finish every launched step
STOP = object()  # finish every launched step, then end the thread


class StepThread:
    def __init__(self, make_runner: Callable[[], object]) -> None:
        self._make_runner = make_runner
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.results: queue.SimpleQueue = queue.SimpleQueue()  # StepDone, then STOP when the thread ends
        self._ready = threading.Event()
        self.runner = None
        self.error: BaseException | None = None  # why the runner could not be built
        self._log = get_logger("step_thread")
        self._thread = threading.Thread(target=self._run, name="loraledger-steps", daemon=True)
        self._thread.start()

    def wait_ready(self) -> object:
        """Block until the runner is built; return it, or raise why it could not be."""
        self._ready.wait()
        if self.error is not None:
            raise self.error
        return self.runner

    def submit(self, plan: StepPlan) -> None:
        self._inbox.put(plan)

    def flush(self) -> None:
        self._inbox.put(FLUSH)

    def stop(self, timeout: float | None = None) -> bool:
        """Finish what is launched and end the thread; True once it has ended."""
        self._inbox.put(STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self.runner = self._make_runner()
        except BaseException as exc:  # reported by wait_ready(); nothing else runs
            self.error = exc
            self._ready.set()
            self.results.put(STOP)
            return
        self._ready.set()
        launched: deque = deque()
        try:
            while True:
                msg = self._inbox.get()
                if msg is STOP or msg is FLUSH:
                    while launched:
                        self._finish(launched.popleft())
                    if msg is STOP:
                        return
                    continue
                try:
                    step = self.runner.launch(msg)
                except Exception as exc:  # a failing step fails its requests, not the engine
                    while launched:  # results go out in plan order
                        self._finish(launched.popleft())
                    self._log.exception("step raised", step_id=msg.step_id)
                    self.results.put(StepDone(output=None, error=exc, step_id=msg.step_id))
                    continue
                launched.append(step)
                while len(launched) > 1:  # the newer step is queued behind it: the device stays busy
                    self._finish(launched.popleft())
        finally:
            self.results.put(STOP)

    def _finish(self, step) -> None:
        try:
            output = self.runner.finish(step)
        except Exception as exc:
            self._log.exception("step raised", step_id=step.step_id)
            self.results.put(StepDone(output=None, error=exc, step_id=step.step_id))
        else:
            self.results.put(StepDone(output=output, step_id=step.step_id))
