"""SignalInbox: signals as messages to the event loop. A handler only records the signal and wakes the loop; the work
(a keys reload, the drain's log line) runs later in a task, in normal code.

A Python signal handler runs in the main thread between two bytecodes of whatever that thread was doing, possibly
inside a log call that holds the (non-reentrant) lock of the log's output: a handler that logs, or takes any other
lock, can deadlock the process for good. So a handler here appends to a deque (atomic) and asks the loop, through
its self-pipe, to set an event; nothing else.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable

import anyio

Handler = Callable[[int], Awaitable[None]]


class SignalInbox:
    def __init__(self) -> None:
        self._pending: collections.deque[int] = collections.deque(maxlen=64)  # a burst of signals is not a backlog
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: anyio.Event | None = None

    def post(self, signum: int, _frame: object = None) -> None:
        """The signal handler (signal.signal's signature): record, wake, return."""
        self._pending.append(signum)
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop has closed: nothing is left to tell
                pass

    def _wake(self) -> None:
        if self._event is not None:
            self._event.set()

    async def serve(self, handle: Handler) -> None:
        """Run `handle(signum)` for each signal posted, in order, until cancelled. A failing handler is the caller's
        to log; the inbox goes on."""
        self._loop = asyncio.get_running_loop()
        try:
            while True:
                while self._pending:
                    await handle(self._pending.popleft())
                self._event = anyio.Event()
                if self._pending:  # posted while the event was being replaced
                    continue
                await self._event.wait()
        finally:
            self._loop = None
            self._event = None
