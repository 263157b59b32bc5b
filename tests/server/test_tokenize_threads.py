"""A flood of /tokenize requests takes at most the tokenization routes' own few worker threads: chat requests, whose
rendering needs a thread of the shared pool, still run (before, 40 slow /tokenize calls held every thread)."""

from __future__ import annotations

import threading
import time

import httpx

from loraledger.server.serving_tokenization import TOKENIZE_THREADS
from tests.server.conftest import BASE, server_config
from tests.server.live import LiveServer

FLOOD = 44  # more than anyio's default pool of 40 threads


def test_a_tokenize_flood_leaves_threads_for_chat(tiny_llama_chat, keys, tmp_path):
    with LiveServer(server_config(tiny_llama_chat, tmp_path, keys)) as server:
        tokenizer = server.state.engine.get_tokenizer(None)
        release = threading.Event()
        running = []
        encode = tokenizer.encode

        def slow_encode(text, *args, **kwargs):  # a long text's tokenization, held until the test says
            if isinstance(text, str) and text.startswith("SLOW"):
                running.append(1)
                release.wait(60)
            return encode(text, *args, **kwargs)

        tokenizer.encode = slow_encode
        headers = {"Authorization": f"Bearer {keys.acme}"}
        statuses: list[int] = []

        def tokenize() -> None:
            r = httpx.post(f"{server.base_url}/tokenize", json={"model": BASE, "prompt": "SLOW text"},
                           headers=headers, timeout=90)  # fmt: skip
            statuses.append(r.status_code)

        flood = [threading.Thread(target=tokenize) for _ in range(FLOOD)]
        try:
            for t in flood:
                t.start()
            deadline = time.monotonic() + 30
            while len(running) < 4:  # the flood has reached the tokenizer
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(1.0)  # the rest of the flood has arrived, and is queued
            body = {"model": BASE, "messages": [{"role": "user", "content": "still served?"}], "max_tokens": 4}
            started = time.monotonic()
            r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers, timeout=15)
            assert r.status_code == 200, r.text
            print(f"chat answered in {time.monotonic() - started:.2f} s beside {FLOOD} held /tokenize calls")
            assert len(running) == TOKENIZE_THREADS
        finally:
            release.set()
            for t in flood:
                t.join(timeout=90)
            tokenizer.encode = encode
        assert set(statuses) <= {200, 503} and statuses.count(200) >= TOKENIZE_THREADS, statuses
