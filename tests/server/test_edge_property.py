"""Property at the HTTP edge: whatever bodies and headers callers send to a running server, good traffic alongside
still finishes in its usual time, every answer is 2xx or an OpenAI error object below 500, nothing released is
missing from the audit log, and the log verifies.

Hypothesis generates request bodies (every field of the completion and chat shapes, with values of every JSON
type, huge numbers, long and lone-surrogate strings, nested junk), raw non-JSON bytes, and headers (keys missing,
wrong, of another tenant; X-Request-Ids of every shape, including other responses' ids; odd content types).
"""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraledger.audit import AuditLog
from tests.server.audit_rows import binding, completions
from tests.server.conftest import BASE

MAX_EXAMPLES = int(os.environ.get("LORALEDGER_FUZZ_EXAMPLES", "60"))
ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/load_lora_adapter"]
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "bad_words", "logit_bias", "allowed_token_ids", "logprobs", "top_logprobs",
    "prompt_logprobs", "echo", "stream", "stream_options", "ignore_eos", "min_tokens", "truncate_prompt_tokens",
    "chat_template", "chat_template_kwargs", "add_special_tokens", "response_format", "structured_outputs",
    "guided_regex", "guided_choice", "vllm_xargs", "user", "tokens", "lora_name", "lora_path", "priority",
]  # fmt: skip
MODELS = [BASE, "qv_r4", "all_r8", "nope", "", "x" * 300]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-5, 300),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
    st.sampled_from(["\ud800", "a\udc00b", "{{ 'x' * 99999999 }}", "{% for i in range(99999) %}x{% endfor %}"]),
)  # fmt: skip
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)  # fmt: skip


@st.composite
def bodies(draw, route: str, rng) -> dict:
    body: dict = {"model": BASE if rng.random() < 0.7 else rng.choice(MODELS)}
    if rng.random() < 0.7:  # mostly near-valid: the route's own prompt and a small budget, so the engine runs
        if route == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": draw(st.text(max_size=30))}]
        elif route == "/detokenize":
            body["tokens"] = draw(st.lists(st.integers(-3, 600), max_size=8))
        else:
            body["prompt"] = draw(st.text(min_size=1, max_size=30))
        if route in ("/v1/completions", "/v1/chat/completions"):
            body["max_tokens"] = rng.randint(1, 8)
    for name in rng.sample(FIELDS, rng.choice([0, 0, 1, 2, 3])):
        body[name] = draw(values)
    return body


@st.composite
def requests_(draw, keys) -> tuple[str, dict, bytes]:
    rng = draw(st.randoms(use_true_random=True))  # the mix of cases; hypothesis draws the values themselves
    route = rng.choice([*ROUTES[:2]] * 3 + ROUTES)
    headers: dict[str, str] = {}
    if rng.random() < 0.8:  # mostly a key of the server's (acme may use the base model, globex may not)
        auth = rng.choice(["acme", "acme", "globex", "admin"])
    else:
        auth = rng.choice(["none", "bad", "bearer-only", "long"])
    headers["Authorization"] = {
        "acme": f"Bearer {keys.acme}", "globex": f"Bearer {keys.globex}", "admin": f"Bearer {keys.admin}",
        "none": "", "bad": "Bearer ll-not-a-key", "bearer-only": "Bearer", "long": "Bearer " + "k" * 5000,
    }[auth]  # fmt: skip
    if rng.random() < 0.3:
        headers["X-Request-Id"] = draw(  # what a client library lets through (no surrounding spaces)
            st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=0, max_size=300).map(str.strip)
        )
    if rng.random() < 0.1:
        headers["Content-Type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded", ""])
    else:
        headers["Content-Type"] = "application/json"
    if rng.random() < 0.1:
        raw = draw(st.binary(max_size=200))
    else:
        raw = json.dumps(draw(bodies(route, rng))).encode("utf-8", "surrogatepass")
    return route, {k: v for k, v in headers.items() if v}, raw


class GoodTraffic:
    """Short greedy completions, one after another, while the examples run: their times and ids."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.stop = threading.Event()
        self.times: list[float] = []
        self.ids: list[str] = []
        self.failures: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": BASE, "prompt": "the same question", "max_tokens": 4, "temperature": 0}
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60) as http:
            while not self.stop.is_set():
                t = time.perf_counter()
                r = http.post("/v1/completions", json=body)
                self.times.append(time.perf_counter() - t)
                if r.status_code == 200:
                    self.ids.append(r.json()["id"])
                else:
                    self.failures.append(f"{r.status_code} {r.text[:200]}")
                time.sleep(0.05)


@pytest.fixture(scope="module")
def traffic(live, keys):
    with httpx.Client(base_url=live.base_url, headers={"Authorization": f"Bearer {keys.acme}"}, timeout=60) as http:
        alone = []
        for _ in range(3):
            t = time.perf_counter()
            assert (
                http.post("/v1/completions", json={"model": BASE, "prompt": "warm", "max_tokens": 4}).status_code == 200
            )
            alone.append(time.perf_counter() - t)
    good = GoodTraffic(live.base_url, keys.acme)
    good.usual = min(alone)
    good.thread.start()
    yield good
    good.stop.set()
    good.thread.join(timeout=60)


def test_generated_bodies_and_headers_leave_good_traffic_and_the_log_intact(live, keys, traffic):
    seen: dict[int, int] = {}

    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.data())
    def one(data) -> None:
        route, headers, raw = data.draw(requests_(keys))
        r = httpx.post(f"{live.base_url}{route}", content=raw, headers=headers, timeout=60)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500 or r.status_code == 503, f"{r.status_code} for {route} {raw[:300]!r}: {r.text[:300]}"
        if r.status_code >= 400:
            error = r.json()["error"]
            assert isinstance(error["message"], str) and error["message"]
        assert httpx.get(f"{live.base_url}/health", timeout=10).status_code == 200

    one()
    print("statuses", dict(sorted(seen.items())), "good requests", len(traffic.ids))
    assert seen.get(200, 0) >= 3 and sum(v for k, v in seen.items() if 400 <= k < 500) >= 10, seen
    traffic.stop.set()
    traffic.thread.join(timeout=60)
    assert not traffic.failures, traffic.failures[:3]
    assert len(traffic.ids) >= 5, f"good traffic barely ran: {len(traffic.ids)} requests ({seen})"
    slowest = max(traffic.times)
    assert slowest < max(5.0, 20 * traffic.usual), f"a good request took {slowest:.2f} s (usual {traffic.usual:.2f} s)"
    for rid in traffic.ids:  # everything released is on record
        assert binding(live.audit_url, rid) is not None and completions(live.audit_url, rid), rid
    with AuditLog(live.audit_url) as log:
        result = log.verify()
    assert result.ok, result.problems
