"""A client that stops reading its answer does not hold the server: a write that cannot go out within the send
deadline ends the request (a stream is aborted, on record), and its place in the server's capacity is freed."""

from __future__ import annotations

import json
import socket
import time

import httpx
from sqlalchemy import select

from loraledger.server.limits import ServerLimits
from loraledger.store.audit_store import REQUESTS
from loraledger.store.records import EventKind
from tests.server.audit_rows import events, query
from tests.server.conftest import BASE, server_config
from tests.server.live import LiveServer

SEND_SECONDS = 1.0


def _stalled_stream(port: int, key: str) -> socket.socket:
    """A streamed request for a long answer with every logprob, from a socket that never reads."""
    body = json.dumps({"model": BASE, "prompt": "a slow reader", "max_tokens": 240, "ignore_eos": True,
                       "logprobs": 20, "n": 24, "stream": True}).encode()  # fmt: skip
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # a small window: the server's writes back up
    sock.connect(("127.0.0.1", port))
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer {key}"
            f"\r\nX-Request-Id: slow-reader\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    sock.sendall(head.encode() + body)
    return sock


def test_a_client_that_stops_reading_is_cut_off_and_frees_its_place(tiny_llama_chat, keys, tmp_path):
    config = server_config(
        tiny_llama_chat, tmp_path, keys, max_pending_requests=1, limits=ServerLimits(send_seconds=SEND_SECONDS)
    )
    with LiveServer(config) as server:
        sock = _stalled_stream(server.port, keys.acme)
        try:
            deadline = time.monotonic() + 30
            while server.state.in_flight == 0:  # admitted and streaming into a full pipe
                assert time.monotonic() < deadline
                time.sleep(0.01)
            started = time.monotonic()
            body = {"model": BASE, "prompt": "a good caller", "max_tokens": 4}
            headers = {"Authorization": f"Bearer {keys.acme}"}
            while True:  # the only place is the slow reader's until its send deadline passes
                r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=30)
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and r.json()["error"]["code"] == "over_capacity", r.text
                assert time.monotonic() - started < SEND_SECONDS + 20, "the slow reader holds its place for good"
                time.sleep(0.1)
            url = f"sqlite:///{tmp_path / 'audit.db'}"
            [audit_id] = [r.request_id for r in query(url, select(REQUESTS.c.request_id).where(
                REQUESTS.c.caller_request_id == "slow-reader"))]  # fmt: skip
            # on record either way: aborted when the cut came while it was generating; finished when the engine had
            # released all 24 x 240 tokens before the send deadline cut the stream (a quiet machine is that fast)
            ended = (EventKind.REQUEST_ABORTED, EventKind.REQUEST_FINISHED)
            while not [e for e in events(url, None, audit_id) if e.kind in ended]:
                assert time.monotonic() - started < 30, "the cut-off stream is not on record"
                time.sleep(0.05)
        finally:
            sock.close()
