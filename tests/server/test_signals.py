"""Signals against a running `loraledger serve`: a storm of SIGHUPs under traffic, then SIGTERM, never freezes it (a
handler that logs can deadlock on the log's lock); a SIGHUP with an empty keys file keeps the old keys."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from loraledger.server.auth import add_key
from tests.server.live import ServerProcess

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")


def _args(tiny, keys_file, tmp_path) -> list[str]:
    return [str(tiny.model_dir), "--served-model-name", "tiny", "--api-keys", str(keys_file), "--block-size", "4",
            "--audit-url", f"sqlite:///{tmp_path / 'audit.db'}", "--shutdown-grace", "1", "--num-threads", "1",
            "--log-level", "info"]  # fmt: skip


def test_sighups_empty_keys_then_a_storm_under_traffic_then_sigterm(tiny_llama, tmp_path):
    keys_file = tmp_path / "keys.toml"
    _, key = add_key(keys_file, tenant="acme", adapters=["tiny"])
    headers = {"Authorization": f"Bearer {key}"}
    log_file = tmp_path / "server.log"
    with ServerProcess(_args(tiny_llama, keys_file, tmp_path), log=log_file) as server:
        # an empty keys file (what a reader sees in the middle of an editor's truncate-and-write) keeps the old keys
        kept = keys_file.read_text()
        keys_file.write_text("")
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "holds no keys" not in log_file.read_text():
            assert time.monotonic() < deadline, "the reload's refusal was not logged"
            time.sleep(0.05)
        assert httpx.get(f"{server.base_url}/v1/models", headers=headers, timeout=10).status_code == 200
        keys_file.write_text(kept)

        stop = threading.Event()
        answered: list[int] = []

        def traffic() -> None:  # every request writes access-log lines: the main thread is often inside a log call
            with httpx.Client(base_url=server.base_url, timeout=10, headers=headers) as http:
                while not stop.is_set():
                    try:
                        answered.append(http.get("/v1/models").status_code)
                    except httpx.HTTPError:
                        answered.append(0)

        workers = [threading.Thread(target=traffic, daemon=True) for _ in range(2)]
        for w in workers:
            w.start()
        sent = 0
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            server.proc.send_signal(signal.SIGHUP)
            sent += 1
            time.sleep(0.002)
        # the server still answers after the storm (a deadlocked main thread answers nothing)
        assert httpx.get(f"{server.base_url}/v1/models", headers=headers, timeout=10).status_code == 200
        stop.set()
        for w in workers:
            w.join(timeout=15)
        server.proc.send_signal(signal.SIGTERM)
        try:
            code = server.proc.wait(timeout=15)
        except Exception:
            pytest.fail(f"the server froze: no exit within 15 s of SIGTERM after {sent} SIGHUPs")
        assert code == 0
        assert answered and answered.count(200) == len(answered)
    log = log_file.read_text()
    assert "keys file reloaded" in log and "shutting down" in log


def test_signal_handlers_only_set_flags(tiny_llama, tmp_path):
    """What a signal handler does must not log (nor take any lock): checked directly, as the storm above may miss it."""
    import structlog

    from loraledger import EngineArgs
    from loraledger.server import ServerConfig
    from loraledger.server.app import ServerState

    keys_file = tmp_path / "keys.toml"
    add_key(keys_file, tenant="acme", adapters=["tiny"])
    config = ServerConfig(engine_args=EngineArgs(model=str(tiny_llama.model_dir)), api_keys_file=str(keys_file))
    state = ServerState(config)
    with structlog.testing.capture_logs() as logged:
        state.signals.post(signal.SIGHUP)
        state.mark_draining()
        state.signals.post(signal.SIGTERM)
    assert logged == []
    assert state.draining
