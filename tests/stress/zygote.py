"""The engine processes of the crash tests: a warm "zygote" that forks one engine per run, and its line protocol.

`Zygote(model_dir, stderr_path)` starts `python -m tests.stress.engine_child --zygote` (it imports
torch and transformers once: seconds); `zygote.run(run_argv(...))` forks an engine process and
returns an `EngineRun`, whose `expect` / `read_for` read what it prints and whose `kill` SIGKILLs
it and returns every line it printed before it died. `parse_lines` sorts those lines.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
IMPORT_TIMEOUT_S = 180.0  # the zygote's imports of torch and transformers on a busy 2-core machine
RUN_TIMEOUT_S = 60.0


class ChildError(RuntimeError):
    """The engine process died on its own, or did not say what it should have in time."""


class Zygote:
    """A `tests.stress.engine_child --zygote` process: imports the engine once, then forks one engine process per run.

    Only one run at a time: its lines and the zygote's share the zygote's stdout, read in a thread.
    """

    def __init__(self, model_dir: str | Path, stderr_path: Path) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        env["TOKENIZERS_PARALLELISM"] = "false"  # the zygote forks; no tokenizer thread pool may exist by then
        self.stderr_path = stderr_path
        self._stderr = open(stderr_path, "w")
        argv = [sys.executable, "-m", "tests.stress.engine_child", "--zygote", "--model", str(model_dir)]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            bufsize=1,
            cwd=REPO_ROOT,
            env=env,
        )
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._ready = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def next_line(self, timeout: float) -> str:
        """The next line; raises ChildError at EOF and queue.Empty after timeout seconds."""
        line = self._queue.get(timeout=max(timeout, 0.0))
        if line is None:
            self._queue.put(None)
            raise ChildError(f"the zygote exited (rc={self.proc.wait()}){self.tail()}")
        return line

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_ready(self, timeout: float = IMPORT_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready:
            try:
                self._ready = self.next_line(deadline - time.monotonic()) == "READY"
            except queue.Empty:
                raise ChildError(f"the zygote did not finish its imports within {timeout:.0f}s{self.tail()}") from None

    def run(self, argv: Sequence[str]) -> EngineRun:
        """Fork an engine process running `engine_child.run(argv)`."""
        self.wait_ready()
        self.send("RUN " + json.dumps(list(argv)))
        return EngineRun(self)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # it holds nothing worth a clean exit, and torch's interpreter shutdown takes seconds
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass  # the pipe to a dead process may refuse a final flush
        self._stderr.close()

    def tail(self) -> str:
        self._stderr.flush()
        text = self.stderr_path.read_text(errors="replace")[-3000:]
        return f"; stderr ends with:\n{text}" if text else ""

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class EngineRun:
    """One forked engine process: what it printed so far, and SIGKILL."""

    def __init__(self, zygote: Zygote) -> None:
        self._zygote = zygote
        self.lines: list[str] = []
        self.pid: int | None = None
        self.exited = False

    def _next(self, timeout: float) -> str:
        line = self._zygote.next_line(timeout)
        word, _, rest = line.partition(" ")
        if word == "PID":
            self.pid = int(rest)
        elif word == "EXIT":
            self.exited = True
        self.lines.append(line)
        return line

    def count(self, word: str) -> int:
        return sum(1 for line in self.lines if line.split(" ", 1)[0] == word)

    def expect(self, word: str, times: int = 1, timeout: float = RUN_TIMEOUT_S) -> None:
        """Read on until `word` has started `times` lines in all."""
        deadline = time.monotonic() + timeout
        while self.count(word) < times:
            if self.exited:
                raise ChildError(
                    f"the engine process ended before {times}x {word}: {self.lines[-3:]}{self._zygote.tail()}"
                )
            try:
                self._next(deadline - time.monotonic())
            except queue.Empty:
                raise ChildError(
                    f"no {times}x {word} from the engine process within {timeout:.0f}s{self._zygote.tail()}"
                ) from None

    def read_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and not self.exited:
            try:
                self._next(left)
            except queue.Empty:
                return
        if self.exited:
            raise ChildError(f"the engine process ended on its own: {self.lines[-3:]}{self._zygote.tail()}")

    def kill(self) -> list[str]:
        """SIGKILL; once it is gone, every line it printed (they all come before the zygote's SYNCED)."""
        if not self.exited:
            self.expect("PID", timeout=30)
        if not self.exited:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 30
            while _alive(self.pid):
                if time.monotonic() > deadline:
                    raise ChildError(f"engine process {self.pid} still exists 30s after SIGKILL")
                time.sleep(0.01)
        self._zygote.send("SYNC")
        while self._next(RUN_TIMEOUT_S) != "SYNCED":
            pass
        self.lines.pop()
        return self.lines


def _alive(pid: int) -> bool:
    """Whether pid still runs (a zombie does not: it is dead, only not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass  # no /proc: ask the kernel
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run_argv(
    model_dir: str | Path,
    loras: Mapping[str, str | Path],
    url: str,
    prefix: str,
    *,
    seed: int,
    extra: Sequence[str] = (),
) -> list[str]:
    """The arguments of one engine run (see tests.stress.engine_child)."""
    argv = ["--model", str(model_dir), "--url", url, "--prefix", prefix, "--seed", str(seed)]
    for name, path in loras.items():
        argv += ["--lora", f"{name}={path}"]
    return [*argv, *extra]


def parse_lines(lines: Sequence[str]) -> tuple[set[str], dict[str, int], list[str]]:
    """(admitted ids, released id -> number of completions, odd lines: FAILED, DONE or EXIT)."""
    admitted: set[str] = set()
    released: dict[str, int] = {}
    odd: list[str] = []
    for line in lines:
        word, _, rest = line.partition(" ")
        if word == "ADMITTED":
            admitted.add(rest)
        elif word == "RELEASED":
            rid, n = rest.rsplit(" ", 1)
            released[rid] = int(n)
        elif word in ("FAILED", "DONE", "EXIT"):
            odd.append(line)
    return admitted, released, odd
