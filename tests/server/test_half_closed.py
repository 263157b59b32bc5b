"""A client that shuts down its write side after sending its request (a half-close, as `curl` over some proxies and
many one-shot scripts do) is still there to read: it gets its answer, or its request is on record as aborted; never a
request left unfinished on record, nor one lost."""

from __future__ import annotations

import json
import socket
import time

import pytest
from sqlalchemy import select

from loraledger.store.audit_store import EVENTS, REQUESTS
from loraledger.store.records import EventKind
from tests.server.audit_rows import query
from tests.server.conftest import BASE

RECORD_WAIT_S = 30.0


def _raw(port: int, route: str, body: dict, headers: dict[str, str]) -> bytes:
    payload = json.dumps(body).encode()
    head = [f"POST {route} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
            f"Content-Length: {len(payload)}", "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]  # fmt: skip
    return ("\r\n".join(head) + "\r\n\r\n").encode() + payload


def _half_closed_call(port: int, request: bytes, timeout: float = 60.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)  # nothing more from us; we still read
        reply = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
        return reply


def _outcome(url: str, caller_id: str) -> tuple[str | None, list[str]]:
    rows = query(url, select(REQUESTS.c.request_id).where(REQUESTS.c.caller_request_id == caller_id))
    if not rows:
        return None, []
    audit_id = rows[0].request_id
    kinds = [r.kind for r in query(url, select(EVENTS.c.kind).where(EVENTS.c.request_id == audit_id))]
    return audit_id, kinds


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_half_closed_client_gets_its_answer_or_an_aborted_record(live, keys, route, stream):
    body = {"model": BASE, "max_tokens": 24, "temperature": 0, "stream": stream}
    if route == "/v1/completions":
        body["prompt"] = "a half-closed caller"
    else:
        body["messages"] = [{"role": "user", "content": "a half-closed caller"}]
    caller_id = f"half-{route.rsplit('/', 1)[1]}-{int(stream)}-{time.monotonic_ns()}"
    request = _raw(live.port, route, body, {"Authorization": f"Bearer {keys.acme}", "X-Request-Id": caller_id})
    reply = _half_closed_call(live.port, request)
    deadline = time.monotonic() + RECORD_WAIT_S
    while True:
        audit_id, kinds = _outcome(live.audit_url, caller_id)
        ended = [k for k in kinds if k in EventKind.TERMINAL]
        if ended or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    status = reply.split(b"\r\n", 1)[0]
    assert audit_id is not None, f"the request is not on record at all; the client got {reply[:300]!r}"
    assert ended, (
        f"request {audit_id} still unfinished on record {RECORD_WAIT_S} s later ({kinds}); reply {reply[:300]!r}"
    )
    if ended == [EventKind.REQUEST_FINISHED]:
        # finished: the caller read all of it
        assert status == b"HTTP/1.1 200 OK", reply[:300]
        if stream:
            assert b"data: [DONE]" in reply and reply.endswith(b"\r\n0\r\n\r\n"), reply[-300:]  # the last chunk
        else:
            text = reply.split(b"\r\n\r\n", 1)[1]
            assert json.loads(text)["usage"]["completion_tokens"] > 0
    else:
        assert ended == [EventKind.REQUEST_ABORTED], kinds


def test_a_client_that_closed_for_good_is_found_at_the_first_write(live, keys):
    """A full close looks like a half-close when it arrives; the stream's first write finds the client gone, and the
    request is aborted on record long before its 200 tokens."""
    body = {"model": BASE, "prompt": "a caller who leaves", "max_tokens": 200, "ignore_eos": True, "stream": True}
    caller_id = f"gone-{time.monotonic_ns()}"
    request = _raw(
        live.port, "/v1/completions", body, {"Authorization": f"Bearer {keys.acme}", "X-Request-Id": caller_id}
    )
    with socket.create_connection(("127.0.0.1", live.port), timeout=30) as sock:
        sock.sendall(request)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")  # admitted and streaming
    deadline = time.monotonic() + RECORD_WAIT_S
    while EventKind.REQUEST_ABORTED not in (kinds := _outcome(live.audit_url, caller_id)[1]):
        assert time.monotonic() < deadline, f"the request was not aborted on record: {kinds}"
        time.sleep(0.05)
    assert EventKind.REQUEST_FINISHED not in kinds
