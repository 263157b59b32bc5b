"""The budget of one Hub fetch: a deadline the caller never waits past, and a byte limit checked as bytes arrive."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from loraledger.sources.hub_errors import HubError
from loraledger.sources.hub_settings import HubSettings

T = TypeVar("T")


class Stop(Exception):
    """Raised from inside a download to cut it short: the deadline passed, or more bytes came than allowed."""


class Budget:
    """The deadline and the byte limit of one fetch, checked with each chunk a download receives."""

    def __init__(self, deadline: float, settings: HubSettings, stop: threading.Event) -> None:
        self.deadline, self.max_bytes, self.stop = deadline, settings.max_bytes, stop
        self.received = 0

    def remaining(self) -> float:
        return max(0.001, self.deadline - time.monotonic())

    def add(self, n: int) -> None:
        self.received += n
        if self.stop.is_set() or time.monotonic() > self.deadline:
            raise Stop("deadline")
        if self.received > self.max_bytes:
            raise Stop("size")

    def progress_class(self) -> type:
        """A tqdm class (what huggingface_hub reports download progress to) that charges each chunk to this budget."""
        from tqdm.std import tqdm

        budget = self

        class Charged(tqdm):
            def __init__(self, *args, **kwargs) -> None:
                kwargs.pop("name", None)
                kwargs["disable"] = True
                super().__init__(*args, **kwargs)

            def update(self, n=1):
                if n and n > 0:
                    budget.add(int(n))
                return super().update(n)

        return Charged


def run_within(seconds: float, work: Callable[[threading.Event], T], timed_out: Callable[[], HubError]) -> T:
    """work(stop) in a thread of its own, waited for `seconds` at most; then `stop` is set and timed_out() raised."""
    box: list = []
    done, stop = threading.Event(), threading.Event()

    def run() -> None:
        try:
            box.append((True, work(stop)))
        except BaseException as exc:  # handed to the caller below
            box.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="hub-fetch", daemon=True).start()
    if not done.wait(seconds):
        stop.set()
        raise timed_out()
    ok, value = box.pop()
    if not ok:
        raise value
    return value
