"""One caller, or nobody, against everyone else: request chat templates, clients without keys or slow with their bodies,
and oversized stop lists must cost their sender a refusal and the other callers nothing."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import psutil
import pytest

from tests.server.conftest import BASE, server_config
from tests.server.live import LiveServer

CHAT = [{"role": "user", "content": "hi"}]
LOOPING = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
GROWING = "{{ 'x' * 1500000000 }}"


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _error(r: httpx.Response) -> dict:
    return r.json()["error"]


# --- chat templates ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_a_template_in_chat_template_kwargs_is_refused_without_the_flag(live, keys, route):
    body = {"model": BASE, "messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 'owned' }}"}}
    if route == "/v1/chat/completions":
        body["max_tokens"] = 1
    r = httpx.post(f"{live.base_url}{route}", json=body, headers=_auth(keys.acme), timeout=10)
    assert r.status_code == 400, r.text
    assert _error(r)["param"] == "chat_template_kwargs.chat_template"
    assert "--trust-request-chat-template" in _error(r)["message"]


def _health_latency(url: str, stop: threading.Event, worst: list[float]) -> None:
    with httpx.Client(timeout=30) as http:
        while not stop.is_set():
            t = time.perf_counter()
            http.get(f"{url}/health")
            worst[0] = max(worst[0], time.perf_counter() - t)
            time.sleep(0.05)


def test_trusted_request_templates_render_in_a_bounded_sandbox(tiny_llama_chat, keys, tmp_path):
    limits = __import__("loraledger.server.limits", fromlist=["ServerLimits"]).ServerLimits(chat_template_seconds=1.5)
    config = server_config(tiny_llama_chat, tmp_path, keys, trust_request_chat_template=True, limits=limits)
    with LiveServer(config) as server:
        url = server.base_url
        ok = httpx.post(f"{url}/tokenize", headers=_auth(keys.acme), timeout=90,
                        json={"model": BASE, "messages": CHAT, "chat_template": "[{{ messages[0]['content'] }}]"})  # fmt: skip
        assert ok.status_code == 200, ok.text  # a request template still works (the first render starts the worker)
        rss = psutil.Process(os.getpid()).memory_info().rss
        for template in (LOOPING, GROWING):
            stop, worst = threading.Event(), [0.0]
            watcher = threading.Thread(target=_health_latency, args=(url, stop, worst), daemon=True)
            watcher.start()
            t = time.perf_counter()
            r = httpx.post(f"{url}/v1/chat/completions", headers=_auth(keys.acme), timeout=60, json={
                "model": BASE, "messages": CHAT, "max_tokens": 1, "chat_template_kwargs": {"chat_template": template},
            })  # fmt: skip
            took = time.perf_counter() - t
            stop.set()
            watcher.join(timeout=10)
            assert r.status_code == 400, r.text
            assert took < 15, f"a hostile template held its request {took:.1f} s"
            assert worst[0] < 1.0, f"/health waited {worst[0]:.2f} s while a template rendered"
        grown = psutil.Process(os.getpid()).memory_info().rss - rss
        assert grown < 200 << 20, f"the server grew by {grown >> 20} MiB"
        again = httpx.post(f"{url}/v1/chat/completions", headers=_auth(keys.acme), timeout=90,
                           json={"model": BASE, "messages": CHAT, "max_tokens": 2, "chat_template": "{{ messages[0]['content'] }}"})  # fmt: skip
        assert again.status_code == 200, again.text  # a new worker took the killed one's place


# --- clients without keys, and slow clients ------------------------------------------------------------------


def _half_request(port: int, key: str | None = None) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    s.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}Content-Length: 10\r\n\r\n".encode()
    )
    return s


def test_clients_without_keys_or_bodies_do_not_lock_out_tenants(tiny_llama_chat, keys, tmp_path):
    from loraledger.server.limits import ServerLimits

    config = server_config(
        tiny_llama_chat, tmp_path, keys, max_pending_requests=8,
        limits=ServerLimits(body_seconds=1.5, max_body_readers=4),
    )  # fmt: skip
    with LiveServer(config) as server:
        anonymous = [_half_request(server.port) for _ in range(32)]
        try:
            # every keyless one is answered 401 at once, without waiting for its body
            for s in anonymous[:4]:
                assert s.recv(64).startswith(b"HTTP/1.1 401")
            good = httpx.post(f"{server.base_url}/v1/completions", headers=_auth(keys.acme), timeout=30,
                              json={"model": BASE, "prompt": "hello", "max_tokens": 3})  # fmt: skip
            assert good.status_code == 200, good.text
            # a slow client with a key waits in the slow clients' budget, gets 408 at the body deadline, and never
            # counts against the requests in flight
            slow = [_half_request(server.port, keys.acme) for _ in range(3)]
            time.sleep(0.9)  # past the half second after which a body still missing counts as slow
            assert server.state.in_flight == 0 and server.state.body_readers == 3
            good = httpx.post(f"{server.base_url}/v1/completions", headers=_auth(keys.acme), timeout=30,
                              json={"model": BASE, "prompt": "hello", "max_tokens": 3})  # fmt: skip
            assert good.status_code == 200, good.text
            for s in slow:
                s.settimeout(10)
                assert s.recv(64).startswith(b"HTTP/1.1 408")
                s.close()
            assert server.state.body_readers == 0
        finally:
            for s in anonymous:
                s.close()


def test_a_chunked_body_over_the_limit_is_413(live, keys):
    def chunks():
        for _ in range(10):
            yield b"x" * (1 << 20)

    r = httpx.post(f"{live.base_url}/v1/completions", content=chunks(), timeout=30,
                   headers={**_auth(keys.acme), "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 413 and _error(r)["code"] == "request_too_large"


# --- stop lists and other caller-controlled counts -------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("stop", [f"s{i}" for i in range(200_000)], "--max-stop-strings"),
        ("stop", [f"s{i}" for i in range(65)], "--max-stop-strings"),
        ("stop", ["x" * 5000, "y" * 5000], "--max-stop-chars"),
        ("bad_words", [f"w{i}" for i in range(65)], "--max-stop-strings"),
        ("stop_token_ids", list(range(5000)), "--max-token-id-list"),
        ("allowed_token_ids", [1] * 5000, "--max-token-id-list"),
        ("logit_bias", {str(i): 1.0 for i in range(1100)}, "--max-logit-bias"),
    ],
)
def test_lists_over_their_bounds_are_400(live, keys, field, value, flag):
    body = {"model": BASE, "prompt": "hi", "max_tokens": 1, "n": 32, field: value}
    t = time.perf_counter()
    r = httpx.post(f"{live.base_url}/v1/completions", content=json.dumps(body), timeout=30,
                   headers={**_auth(keys.acme), "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    assert _error(r)["param"] == field and flag in _error(r)["message"]
    assert time.perf_counter() - t < 5


def test_a_stop_list_at_its_bound_works_and_does_not_stall_others(live, keys):
    stops = [f"zz{i:03d}" + "q" * 100 for i in range(64)]
    heavy = {"model": BASE, "prompt": "hi", "max_tokens": 24, "n": 8, "ignore_eos": True, "stop": stops}
    light = {"model": BASE, "prompt": "hello", "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=live.base_url, headers=_auth(keys.acme), timeout=60) as http:
        t = time.perf_counter()
        assert http.post("/v1/completions", json=light).status_code == 200
        alone = time.perf_counter() - t
        done: list[int] = []
        worker = threading.Thread(target=lambda: done.append(http.post("/v1/completions", json=heavy).status_code))
        worker.start()
        t = time.perf_counter()
        assert http.post("/v1/completions", json=light).status_code == 200
        beside = time.perf_counter() - t
        worker.join(timeout=60)
    assert done == [200]
    assert beside < max(2.0, 10 * alone), (
        f"an 8-token request took {beside:.2f} s beside the stop list ({alone:.2f} s alone)"
    )


# --- work on the event loop, metrics labels, several prompts ------------------------------------------------------


def test_tokenize_runs_off_the_event_loop_and_is_bounded(live, keys):
    stop, worst = threading.Event(), [0.0]
    watcher = threading.Thread(target=_health_latency, args=(live.base_url, stop, worst), daemon=True)
    watcher.start()
    big = " ".join(f"w{i % 97}" for i in range(500_000))  # about 2.4 MB of text
    r = httpx.post(
        f"{live.base_url}/tokenize", headers=_auth(keys.acme), timeout=60, json={"model": BASE, "prompt": big}
    )
    stop.set()
    watcher.join(timeout=10)
    assert r.status_code == 200 and r.json()["count"] > 100_000
    assert worst[0] < 1.0, f"/health waited {worst[0]:.2f} s while a long text was tokenized"
    over = httpx.post(f"{live.base_url}/tokenize", headers=_auth(keys.acme), timeout=60,
                      json={"model": BASE, "prompt": "x" * (5 << 20)})  # fmt: skip
    assert over.status_code == 400 and "--max-rendered-chars" in _error(over)["message"]


def test_unknown_model_names_never_become_metric_labels_and_metrics_need_a_key(live, keys):
    with httpx.Client(base_url=live.base_url, headers=_auth(keys.admin), timeout=30) as http:
        for i in range(200):
            r = http.post("/v1/completions", json={"model": f"made-up-{i}", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 404
        text = http.get("/metrics").text
    assert "made-up-" not in text and 'adapter="unknown"' in text
    assert httpx.get(f"{live.base_url}/metrics", timeout=10).status_code == 401


def test_several_prompts_in_one_body_run_together(live, keys):
    def timed(prompts) -> float:
        body = {"model": BASE, "prompt": prompts, "max_tokens": 24, "ignore_eos": True}
        t = time.perf_counter()
        r = httpx.post(f"{live.base_url}/v1/completions", headers=_auth(keys.acme), json=body, timeout=120)
        assert r.status_code == 200 and len(r.json()["choices"]) == len(prompts)
        return time.perf_counter() - t

    timed(["warm"])
    # the best of three, one and four interleaved: on a busy machine a single timing is mostly the machine's load
    ones, fours = [], []
    for _ in range(3):
        ones.append(timed(["a"]))
        fours.append(timed(["a", "b", "c", "d"]))
    one, four = min(ones), min(fours)
    assert four < 2.5 * one, f"4 prompts took {four:.2f} s against {one:.2f} s for one: run one after another"


def test_bad_text_and_token_ids_are_400_not_500(live, keys):
    h = _auth(keys.acme)
    echo = {"model": BASE, "prompt": [-1], "max_tokens": 1, "echo": True}
    r = httpx.post(f"{live.base_url}/v1/completions", headers=h, json=echo, timeout=30)
    assert r.status_code == 400, r.text
    surrogate = '{"model": "MODEL", "messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 1}'
    surrogate = surrogate.replace("MODEL", BASE)
    r = httpx.post(f"{live.base_url}/v1/chat/completions", content=surrogate, timeout=30,
                   headers={**h, "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    r = httpx.post(f"{live.base_url}/tokenize", content='{"model": "MODEL", "prompt": "a\\udc00"}'.replace("MODEL", BASE), timeout=30,
                   headers={**h, "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text


# --- connections: header deadline and per-client cap --------------------------------------------------------------


def _closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        return s.recv(64) == b""
    except TimeoutError:
        return False
    except OSError:  # reset: closed too
        return True


def test_idle_and_slowloris_connections_are_closed_and_one_client_is_capped(tiny_llama_chat, keys, tmp_path):
    from loraledger.server.limits import ServerLimits

    limits = ServerLimits(header_seconds=1.0, max_connections_per_client=12)
    with LiveServer(server_config(tiny_llama_chat, tmp_path, keys, limits=limits)) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(10)]
        slow = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        time.sleep(0.2)
        extra = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(4)]
        try:
            # past the 12th connection from this address: closed at once
            assert sum(_closed_within(s, 0.5) for s in extra) >= 3
            started = time.monotonic()
            line = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            closed = False
            for i in range(len(line)):  # a slowloris: one byte every 0.2 s
                try:
                    slow.sendall(line[i : i + 1])
                except OSError:
                    closed = True
                    break
                if _closed_within(slow, 0.2):
                    closed = True
                    break
            assert closed and time.monotonic() - started < 5, "headers sent a byte at a time kept the connection"
            assert all(_closed_within(s, 3) for s in idle), "connections that sent nothing stayed open"
            good = httpx.post(f"{server.base_url}/v1/completions", headers=_auth(keys.acme), timeout=30,
                              json={"model": BASE, "prompt": "hello", "max_tokens": 2})  # fmt: skip
            assert good.status_code == 200, good.text
        finally:
            for s in [*idle, slow, *extra]:
                s.close()


def test_ready_says_when_requests_would_be_refused(live, monkeypatch):
    assert httpx.get(f"{live.base_url}/ready", timeout=10).status_code == 200
    real = live.state.engine.get_metrics

    async def store_down():
        import msgspec

        return msgspec.structs.replace(await real(), audit_store_down=True)

    monkeypatch.setattr(live.state.engine, "get_metrics", store_down)
    r = httpx.get(f"{live.base_url}/ready", timeout=10)
    assert r.status_code == 503 and "audit store" in _error(r)["message"]
    assert httpx.get(f"{live.base_url}/health", timeout=10).status_code == 200  # alive, not ready
