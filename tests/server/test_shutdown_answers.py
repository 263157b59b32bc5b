"""What a caller gets when the server stops under it: an output withheld because the audit store hangs is answered
with an OpenAI error object (JSON, 503) when the grace period ends, never uvicorn's plain-text 500; the request is
not released off the record, and a restart records it as interrupted."""

from __future__ import annotations

import threading
import time

import httpx

from loraledger.audit import AuditLog
from loraledger.errors import AuditUnavailableError
from loraledger.store.audit_store import AuditStore
from tests.server.conftest import BASE, server_config
from tests.server.live import LiveServer

AUDIT_TIMEOUT = 1.0


class HungStore:
    """From arm() on, a write that carries completions hangs for the store's deadline, then fails as a store that
    does not answer does; the withheld outputs wait for it."""

    def __init__(self, monkeypatch) -> None:
        self.armed = False
        self.tried = threading.Event()
        write = AuditStore.write

        def hung_write(store, batch, **kwargs):
            if self.armed and batch.completions:
                self.tried.set()
                time.sleep(AUDIT_TIMEOUT)
                raise AuditUnavailableError("injected: the audit store does not answer")
            return write(store, batch, **kwargs)

        monkeypatch.setattr(AuditStore, "write", hung_write)


def test_withheld_outputs_at_shutdown_get_an_openai_error_object(tiny_llama_chat, keys, tmp_path, monkeypatch):
    hung = HungStore(monkeypatch)
    config = server_config(
        tiny_llama_chat,
        tmp_path,
        keys,
        engine={"audit_timeout": AUDIT_TIMEOUT, "shutdown_timeout": 3.0},
        shutdown_grace_seconds=1.0,
    )
    headers = {"Authorization": f"Bearer {keys.acme}"}
    answers: dict[str, httpx.Response | BaseException] = {}
    bodies = {
        "/v1/completions": {"model": BASE, "prompt": "hello", "max_tokens": 3},
        "/v1/chat/completions": {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    }
    server = LiveServer(config)
    with server:
        hung.armed = True

        def call(route: str) -> None:
            try:
                answers[route] = httpx.post(server.base_url + route, json=bodies[route], headers=headers, timeout=60)
            except BaseException as exc:  # noqa: BLE001 (reported below)
                answers[route] = exc

        callers = [threading.Thread(target=call, args=(route,)) for route in bodies]
        for c in callers:
            c.start()
        assert hung.tried.wait(60), "no output reached the audit store"
        time.sleep(0.3)  # both outputs computed and withheld
    for c in callers:
        c.join(timeout=30)
    for route, answer in answers.items():
        assert isinstance(answer, httpx.Response), (route, answer)
        assert answer.status_code == 503, (route, answer.status_code, answer.text)
        assert answer.headers["content-type"] == "application/json", (route, answer.text)
        error = answer.json()["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "shutting_down", error
        assert "not on record" in error["message"] and "grace" in error["message"], error
    assert set(answers) == set(bodies)
    # the withheld outputs are not on record; a peer (here a tool) records them as interrupted, and the log verifies
    with AuditStore(f"sqlite:///{tmp_path / 'audit.db'}") as store:
        unfinished = store.unfinished_requests()
        assert len(unfinished) == 2, unfinished
        assert sorted(r.request_id for r in store.recover_expired().requests) == sorted(
            r.request_id for r in unfinished
        )
    with AuditLog(f"sqlite:///{tmp_path / 'audit.db'}") as log:
        result = log.verify()
    assert result.ok, result.problems
