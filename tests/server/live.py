"""A real server for the tests: uvicorn on 127.0.0.1 and a free port, in a thread of the test process (LiveServer) or
in a subprocess of its own (ServerProcess: for SIGTERM), over the tiny fixture model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it answered")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"no healthy server at {base_url} within {timeout} s")


class LiveServer:
    """build_app(config) under uvicorn in a thread; `stop()` runs the same shutdown as SIGTERM (lifespan drain)."""

    def __init__(self, config) -> None:
        import uvicorn

        from loraledger.server.app import build_app
        from loraledger.server.connections import uvicorn_options

        self.port = free_port()
        self.app = build_app(config)
        self.state = self.app.state.server
        self.base_url = f"http://127.0.0.1:{self.port}"
        uv = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            timeout_graceful_shutdown=config.shutdown_grace_seconds,
            **uvicorn_options(config.limits),  # the connection guards `loraledger serve` runs with
        )
        self.server = uvicorn.Server(uv)
        self.thread = threading.Thread(target=self.server.run, name="live-server", daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        wait_healthy(self.base_url)
        return self

    def stop(self) -> None:
        self.state.begin_drain()
        self.server.should_exit = True
        self.thread.join(timeout=120)
        assert not self.thread.is_alive(), "the server did not stop"

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerProcess:
    """`loraledger serve ...` in a subprocess (its own signals, its own exit code)."""

    def __init__(self, args: list[str], *, log: Path, env: dict | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable,
            "-m",
            "loraledger.cli",
            "serve",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.log = log
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self._out = open(self.log, "wb")
        self.proc = subprocess.Popen(self.args, stdout=self._out, stderr=subprocess.STDOUT, env=self.env)
        wait_healthy(self.base_url, timeout=120, proc=self.proc)
        return self

    def terminate(self, timeout: float = 120) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._out.close()
