"""Property at the HTTP edge, signals: SIGHUPs and a SIGTERM at generated moments against a running `loraledger
serve` under good traffic (plain and streamed completions). Good requests answered before the SIGTERM are all 200
and on record; those in flight when it lands finish within the grace period (or, arriving after it, get a 503
error object); the server exits 0 within its bound; nothing released is missing from the log, and the log verifies
(the clean stop's marker included).

One server lives through every example (a start costs more than all of them): each example sends its SIGHUPs and
checks the server still answers, its keys hold and good traffic goes on; the SIGTERM lands at the last example's
moment. LORALEDGER_FUZZ_SIGNAL_EXAMPLES sets the number of examples.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraledger.audit import AuditLog
from loraledger.server.auth import add_key
from tests.server.audit_rows import binding, completions
from tests.server.live import ServerProcess

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")

MAX_EXAMPLES = int(os.environ.get("LORALEDGER_FUZZ_SIGNAL_EXAMPLES", "6"))
EXIT_WITHIN_S = 20.0

# SIGHUPs, each after a wait; then the moment of the SIGTERM after them (used by the last example)
schedules = st.tuples(
    st.lists(st.tuples(st.floats(0.0, 0.12), st.just(signal.SIGHUP)), max_size=12),
    st.floats(0.0, 0.6),  # the SIGTERM's moment after the last SIGHUP
)


class Traffic(threading.Thread):
    """One client's good requests, one after another, until told to stop or the server stops answering."""

    def __init__(self, base_url: str, key: str, stream: bool) -> None:
        super().__init__(daemon=True)
        self.base_url, self.key, self.stream = base_url, key, stream
        self.halt = threading.Event()
        self.released: list[str] = []  # ids of outputs the client received whole
        self.refused: list[int] = []  # statuses of refusals (503 while draining)
        self.broken: list[str] = []  # anything else

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "good traffic", "max_tokens": 6, "temperature": 0, "stream": self.stream}
        with httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {self.key}"}, timeout=30) as http:
            while not self.halt.is_set():
                try:
                    self._one(http, body)
                except httpx.TransportError:
                    return  # the server closed its socket after the drain: nothing more to send to
                except Exception as exc:  # noqa: BLE001 (a broken answer is a finding)
                    self.broken.append(f"{type(exc).__name__}: {exc}")

    def _one(self, http: httpx.Client, body: dict) -> None:
        if not self.stream:
            r = http.post("/v1/completions", json=body)
            if r.status_code == 200:
                self.released.append(r.json()["id"])
            elif r.status_code == 503 and r.json()["error"]["code"] == "shutting_down":
                self.refused.append(r.status_code)
            else:
                self.broken.append(f"{r.status_code} {r.text[:200]}")
            return
        with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                if r.status_code == 503 and json.loads(r.text)["error"]["code"] == "shutting_down":
                    self.refused.append(r.status_code)
                else:
                    self.broken.append(f"{r.status_code} {r.text[:200]}")
                return
            rid, done = None, False
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    rid = json.loads(line[6:])["id"]
            if done and rid is not None:
                self.released.append(rid)
            else:
                self.broken.append(f"stream {rid} ended without [DONE]")


def test_signals_at_generated_moments_lose_nothing(tiny_llama, tmp_path):
    keys_file = tmp_path / "keys.toml"
    _, key = add_key(keys_file, tenant="acme", adapters=["tiny"])
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    args = [str(tiny_llama.model_dir), "--served-model-name", "tiny", "--api-keys", str(keys_file),
            "--block-size", "4", "--audit-url", url, "--shutdown-grace", "5", "--num-threads", "1"]  # fmt: skip
    term_after: list[float] = [0.0]  # the SIGTERM's moment: the last example's
    runs: list[int] = []
    with ServerProcess(args, log=tmp_path / "server.log") as server:
        clients = [Traffic(server.base_url, key, stream) for stream in (False, True)]
        for c in clients:
            c.start()

        @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(schedules)
        def one(schedule) -> None:
            hups, term_after[0] = schedule
            before = sum(len(c.released) for c in clients)
            for wait, signum in hups:
                time.sleep(wait)
                server.proc.send_signal(signum)
            # not frozen: it answers, the keys still hold, and good traffic goes on
            r = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5)
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 10
            while sum(len(c.released) for c in clients) <= before:
                assert time.monotonic() < deadline, f"no good request finished within 10 s of {len(hups)} SIGHUPs"
                time.sleep(0.01)
            runs.append(len(hups))

        one()
        time.sleep(term_after[0])
        server.proc.send_signal(signal.SIGTERM)
        try:
            code = server.proc.wait(timeout=EXIT_WITHIN_S)
        except Exception:
            pytest.fail(f"no exit within {EXIT_WITHIN_S} s of SIGTERM")
        for c in clients:
            c.halt.set()
            c.join(timeout=30)
    assert code == 0, (tmp_path / "server.log").read_text()[-2000:]
    released = [rid for c in clients for rid in c.released]
    for c in clients:
        assert not c.broken, c.broken[:3]
    for rid in released:  # everything released is on record
        assert binding(url, rid) is not None and completions(url, rid), rid
    with AuditLog(url) as log:
        result = log.verify()
    assert result.ok, result.problems
    print("SIGHUPs per example", runs, "good requests released", len(released))
