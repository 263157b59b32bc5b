"""Several engine processes at once, forked from one zygote, each printing to its own file (tests.stress.engine_child --out)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from tests.stress.zygote import ChildError, Zygote, _alive

POLL_S = 0.05


class FleetRun:
    """One engine process of a fleet: its lines (read from its file), SIGTERM (a clean stop) and SIGKILL."""

    def __init__(self, zygote: Zygote, argv: Sequence[str], out: Path) -> None:
        self.out = out
        out.write_text("")
        zygote.wait_ready()
        zygote.send("RUN " + json.dumps([*argv, "--out", str(out)]))
        self._zygote = zygote

    @property
    def lines(self) -> list[str]:
        text = self.out.read_text()
        return (
            text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
        )  # a line being written is not one yet

    def words(self, word: str) -> list[str]:
        return [line.partition(" ")[2] for line in self.lines if line.split(" ", 1)[0] == word]

    def expect(self, word: str, times: int = 1, timeout: float = 60.0) -> list[str]:
        """Wait until `word` has started `times` lines; their rests."""
        deadline = time.monotonic() + timeout
        while len(found := self.words(word)) < times:
            if self.words("EXIT") and word != "EXIT":
                raise ChildError(
                    f"{self.out.name}: the engine process ended before {times}x {word}: {self.lines[-3:]}{self._zygote.tail()}"
                )
            if time.monotonic() > deadline:
                raise ChildError(
                    f"{self.out.name}: no {times}x {word} within {timeout:.0f}s: {self.lines[-3:]}{self._zygote.tail()}"
                )
            time.sleep(POLL_S)
        return found

    @property
    def pid(self) -> int:
        return int(self.expect("PID", timeout=30)[0])

    @property
    def instance_id(self) -> str:
        return self.expect("INSTANCE", timeout=120)[0]

    def kill(self) -> list[str]:
        """SIGKILL; once it is gone, every line it printed."""
        pid = self.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _alive(pid):
            if time.monotonic() > deadline:
                raise ChildError(f"engine process {pid} still exists 30s after SIGKILL")
            time.sleep(0.01)
        return self.lines

    def stop(self, timeout: float = 60.0) -> list[str]:
        """SIGTERM: it submits nothing more, finishes what it holds and stops cleanly (EXIT 0); every line it printed."""
        if not self.words("EXIT"):
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass  # it ended on its own meanwhile
        code = self.expect("EXIT", timeout=timeout)[0]
        if code != "0":
            raise ChildError(f"{self.out.name}: EXIT {code}: {self.lines[-3:]}{self._zygote.tail()}")
        return self.lines
