"""The server through the official openai client (and httpx where the client cannot say it): shapes, streaming,
n > 1, logprobs, stop, every error status, keys and permissions, adapters loaded at run time, and the audit log
holding every response's id, caller and fingerprint."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from loraledger.audit import AuditLog
from loraledger.store.audit_store import ADAPTERS, REQUESTS
from loraledger.store.records import EventKind
from tests.server.audit_rows import binding, completions, events, query
from tests.server.conftest import BASE, openai_client

CHAT = [{"role": "user", "content": "all users older than 30"}]


def adapter_fingerprint(url: str, name: str) -> str:
    return query(url, select(ADAPTERS.c.fingerprint).where(ADAPTERS.c.name == name))[0][0]


def test_completion_and_chat_are_bound_to_the_key_and_on_record(live, client, keys):
    r = client.completions.create(
        model="qv_r4", prompt="hello there", max_tokens=5, temperature=0, extra_headers={"X-Request-Id": "client-42"}
    )
    assert r.object == "text_completion" and r.model == "qv_r4" and len(r.choices) == 1
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == r.usage.prompt_tokens + 5
    row = binding(live.audit_url, r.id)
    assert row is not None, "the response id is the request's key in the audit log"
    assert (row.tenant, row.key_id, row.lora_name) == ("acme", keys.ids["acme"], "qv_r4")
    assert r.system_fingerprint == row.adapter_fingerprint == adapter_fingerprint(live.audit_url, "qv_r4")
    assert [c.text for c in completions(live.audit_url, r.id)] == [r.choices[0].text]
    # the response id is the audit key; the client's X-Request-Id is the request's caller id, under the hash chain
    assert row.caller_request_id == "client-42" and r.id != "client-42"
    [admitted] = events(live.audit_url, EventKind.REQUEST_ADMITTED, r.id)
    assert admitted.payload["binding"]["caller_request_id"] == "client-42" and "caller" not in admitted.payload

    c = client.chat.completions.create(
        model=BASE, messages=CHAT, max_completion_tokens=4, temperature=0, user="end-user-7"
    )
    assert c.object == "chat.completion" and c.choices[0].message.role == "assistant"
    row = binding(live.audit_url, c.id)
    assert row.adapter_fingerprint is None and row.tenant == "acme"
    assert c.system_fingerprint == row.base_model_fingerprint  # the base model's fingerprint for base requests
    assert [x.text for x in completions(live.audit_url, c.id)] == [c.choices[0].message.content]
    [admitted] = events(live.audit_url, EventKind.REQUEST_ADMITTED, c.id)
    assert admitted.payload["caller"] == {"user": "end-user-7"}


def test_the_caller_request_id_is_echoed(live, keys):
    r = httpx.post(f"{live.base_url}/v1/completions", headers={"Authorization": f"Bearer {keys.acme}", "X-Request-Id": "abc-1"},
                   json={"model": BASE, "prompt": "hi", "max_tokens": 1})  # fmt: skip
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-1"
    bad = httpx.post(f"{live.base_url}/v1/completions", headers={"Authorization": f"Bearer {keys.acme}", "X-Request-Id": "x" * 300},
                     json={"model": BASE, "prompt": "hi", "max_tokens": 1})  # fmt: skip
    assert bad.status_code == 400 and "X-Request-Id" in bad.json()["error"]["message"]


def test_an_x_request_id_is_the_caller_id_reusable_once_its_request_finished(live, keys):
    """vLLM's request-id rule over HTTP: the client's X-Request-Id names its request; while that request runs a
    second one with the same id is refused (409), and once it finished the id may be used again. Each request has
    its own audit key (the response id), both on record with the client's id."""
    headers = {"Authorization": f"Bearer {keys.acme}", "X-Request-Id": "dup-1"}
    body = {"model": BASE, "prompt": "count to a hundred", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    with httpx.Client(timeout=60) as http:
        with http.stream(
            "POST", f"{live.base_url}/v1/completions", json={**body, "stream": True}, headers=headers
        ) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])["id"]
            clash = http.post(f"{live.base_url}/v1/completions", json={**body, "max_tokens": 1}, headers=headers)
            assert clash.status_code == 409 and _error(clash)["code"] == "duplicate_request_id", clash.text
            assert "dup-1" in _error(clash)["message"]
            for _ in lines:  # the first request runs to its end
                pass
        again = http.post(f"{live.base_url}/v1/completions", json={**body, "max_tokens": 1}, headers=headers)
    assert again.status_code == 200 and again.headers["x-request-id"] == "dup-1"
    second = again.json()["id"]
    assert second != first
    assert (
        binding(live.audit_url, first).caller_request_id == binding(live.audit_url, second).caller_request_id == "dup-1"
    )


def test_streaming_n_logprobs_and_usage_match_the_unstreamed_request(client, live):
    common = dict(model="qv_r4", prompt="the sea", max_tokens=6, temperature=0.9, seed=11, n=2, logprobs=2)
    whole = client.completions.create(**common)
    texts: dict[int, str] = {0: "", 1: ""}
    tokens = {0: 0, 1: 0}
    finish: dict[int, str] = {}
    ids, usage = set(), None
    for chunk in client.completions.create(**common, stream=True, stream_options={"include_usage": True}):
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            tokens[choice.index] += len(choice.logprobs.tokens) if choice.logprobs else 0
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert len(ids) == 1 and binding(live.audit_url, ids.pop()) is not None
    # seeded: each completion draws the same tokens streamed or not (vLLM's seed + i per completion)
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {0: "length", 1: "length"} and tokens == {0: 6, 1: 6}
    assert usage.completion_tokens == 12 == whole.usage.completion_tokens
    for choice in whole.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        assert all(len(top) >= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


def test_chat_streaming_with_role_chunk_logprobs_and_usage(client):
    content, roles, usage, logprobs = "", [], None, 0
    stream = client.chat.completions.create(
        model="qv_r4",
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles += [choice.delta.role] if choice.delta.role else []
            content += choice.delta.content or ""
            if choice.logprobs is not None:
                for entry in choice.logprobs.content:
                    logprobs += 1
                    assert len(entry.top_logprobs) == 3 and entry.bytes == list(entry.token.encode())
    whole = client.chat.completions.create(model="qv_r4", messages=CHAT, max_tokens=5, temperature=0)
    assert roles == ["assistant"] and content == whole.choices[0].message.content
    assert usage.completion_tokens == 5 == logprobs


def test_stop_strings_end_the_completion(client):
    free = client.completions.create(model=BASE, prompt="abc", max_tokens=12, temperature=0).choices[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert stop.strip(), f"pick another prompt: {free!r}"
    r = client.completions.create(model=BASE, prompt="abc", max_tokens=12, temperature=0, stop=[stop])
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert free.startswith(choice.text) and stop not in choice.text


def test_vllm_extras_in_extra_body_reach_the_sampling_params(client, live):
    r = client.completions.create(model=BASE, prompt="x y", max_tokens=3, temperature=0.5,
                                  extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 3, "ignore_eos": True})  # fmt: skip
    params = binding(live.audit_url, r.id).sampling_params
    assert (
        params["top_k"],
        params["min_p"],
        params["repetition_penalty"],
        params["min_tokens"],
        params["ignore_eos"],
    ) == (5, 0.1, 1.2, 3, True)


# --- errors -----------------------------------------------------------------------------------


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "code", "param"} <= set(body["error"])
    return body["error"]


def test_unknown_model_is_404_and_bad_parameters_are_400_with_the_message_kept(live, keys, client):
    with openai_client(live, keys.admin) as admin, pytest.raises(openai.NotFoundError, match="does not exist"):
        admin.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match=r"SamplingParams\.temperature must be a finite number >= 0"):
        client.completions.create(model=BASE, prompt="x", max_tokens=1, temperature=-1)
    with pytest.raises(openai.BadRequestError, match=r"n must be 1 when using greedy sampling"):
        client.chat.completions.create(model=BASE, messages=CHAT, n=2, temperature=0)
    with pytest.raises(openai.BadRequestError, match="temprature"):  # an unknown field is named, not ignored
        client.completions.create(model=BASE, prompt="x", extra_body={"temprature": 0})
    with pytest.raises(openai.BadRequestError, match=r"max_model_len is 256"):
        client.completions.create(model=BASE, prompt=[5] * 300, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="top_logprobs must be in"):
        client.chat.completions.create(model=BASE, messages=CHAT, logprobs=True, top_logprobs=50)


def test_missing_and_bad_keys_are_401_and_counted(live, keys):
    url = f"{live.base_url}/v1/completions"
    before = _metric(live, "loraledger_auth_failures_total")
    r = httpx.post(url, json={"model": BASE, "prompt": "x"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer" and _error(r)["code"] == "invalid_api_key"
    r = httpx.post(url, json={"model": BASE, "prompt": "x"}, headers={"Authorization": "Bearer ll-not-a-key"})
    assert r.status_code == 401
    with openai_client(live, "ll-wrong") as c, pytest.raises(openai.AuthenticationError):
        c.models.list()
    after = _metric(live, "loraledger_auth_failures_total")
    assert after.get((("reason", "missing"),), 0) - before.get((("reason", "missing"),), 0) == 1
    assert after.get((("reason", "invalid"),), 0) - before.get((("reason", "invalid"),), 0) == 2


def test_a_model_the_key_may_not_use_is_403_and_on_record(live, keys, client):
    for model in ("all_r8", "does-not-exist"):  # whether it exists or not: a key learns nothing about other models
        with pytest.raises(openai.PermissionDeniedError, match=f"may not use model `{model}`"):
            client.completions.create(
                model=model, prompt="x", max_tokens=1, extra_headers={"X-Request-Id": f"denied-{model}"}
            )
    with openai_client(live, keys.globex) as globex, pytest.raises(openai.PermissionDeniedError):
        globex.chat.completions.create(model=BASE, messages=CHAT)
    denied = [e.payload for e in events(live.audit_url, EventKind.ACCESS_DENIED)]
    assert {
        "tenant": "acme",
        "key_id": keys.ids["acme"],
        "adapter": "all_r8",
        "route": "/v1/completions",
        "caller_request_id": "denied-all_r8",
    } in denied
    assert {
        "tenant": "globex",
        "key_id": keys.ids["globex"],
        "adapter": BASE,
        "route": "/v1/chat/completions",
    } in denied
    assert all(e.request_id is None for e in events(live.audit_url, EventKind.ACCESS_DENIED))  # no binding
    assert not query(
        live.audit_url, select(REQUESTS).where(REQUESTS.c.lora_name == "all_r8", REQUESTS.c.tenant == "acme")
    )


def test_the_rate_limit_is_429_with_retry_after(live, keys):
    url = f"{live.base_url}/v1/completions"
    headers = {"Authorization": f"Bearer {keys.limited}"}
    codes = [
        httpx.post(url, json={"model": BASE, "prompt": "x", "max_tokens": 1}, headers=headers).status_code
        for _ in range(2)
    ]
    assert codes == [200, 200]
    r = httpx.post(url, json={"model": BASE, "prompt": "x", "max_tokens": 1}, headers=headers)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1 and _error(r)["code"] == "rate_limit_exceeded"


def test_an_oversized_body_is_413(live, keys):
    body = json.dumps({"model": BASE, "prompt": "x" * (9 << 20)})
    r = httpx.post(
        f"{live.base_url}/v1/completions",
        content=body,
        headers={"Authorization": f"Bearer {keys.acme}", "Content-Type": "application/json"},
    )
    assert r.status_code == 413 and _error(r)["code"] == "request_too_large"


def test_over_capacity_is_503_with_retry_after(live, client, monkeypatch):
    monkeypatch.setattr(type(live.state.config), "pending_limit", property(lambda self: 0))
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=BASE, prompt="x", max_tokens=1)
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "1"
    assert "over capacity" in info.value.message


def test_an_unreachable_audit_database_is_503_naming_why(live, client, monkeypatch):
    from loraledger.errors import AuditUnavailableError
    from loraledger.store.audit_store import AuditStore

    def down(store, batch, **kwargs):
        error = AuditUnavailableError("injected outage: the audit store is unreachable")
        error.maybe_committed = False
        raise error

    monkeypatch.setattr(AuditStore, "write", down)
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=BASE, prompt="x", max_tokens=1)
    assert info.value.status_code == 503 and "audit store is unreachable" in info.value.message
    assert info.value.body["code"] == "audit_unavailable" and info.value.response.headers["retry-after"]
    monkeypatch.undo()
    deadline = time.monotonic() + 30
    while True:  # the writer retries with backoff; the store is back
        try:
            client.completions.create(model=BASE, prompt="x", max_tokens=1)
            break
        except openai.InternalServerError:
            assert time.monotonic() < deadline
            time.sleep(0.2)


# --- models, adapters, tokenizer routes --------------------------------------------------------


def test_models_lists_what_the_key_may_use_as_vllm_does(live, keys, client):
    assert [m.id for m in client.models.list().data] == [BASE, "qv_r4"]
    with openai_client(live, keys.globex) as globex:
        assert [m.id for m in globex.models.list().data] == ["all_r8"]
    with openai_client(live, keys.admin) as admin:
        cards = {m.id: m for m in admin.models.list().data}
    assert cards[BASE].model_extra["parent"] is None and cards[BASE].model_extra["root"] == str(live.tiny.model_dir)
    assert cards["qv_r4"].model_extra["parent"] == BASE and cards["qv_r4"].model_extra["root"] == str(
        live.tiny.adapters["qv_r4"]
    )
    assert cards["qv_r4"].model_extra["max_model_len"] == 256


def test_models_retrieve_gives_one_card_and_hides_names_the_key_may_not_use(live, keys, client):
    card = client.models.retrieve("qv_r4")
    assert card.id == "qv_r4" and card.model_extra["parent"] == BASE
    assert client.models.retrieve(BASE).id == BASE
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("all_r8")  # served, but not to this key: not found, as if absent
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with openai_client(live, keys.globex) as globex:
        assert globex.models.retrieve("all_r8").id == "all_r8"


def test_only_admin_keys_load_and_unload_adapters_and_a_loaded_one_is_on_record_first(live, keys):
    url, path = live.base_url, str(live.tiny.adapters["ogd_r16_rslora"])
    body = {"lora_name": "fresh_r8", "lora_path": path}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {keys.acme}"})
    assert r.status_code == 403 and _error(r)["code"] == "admin_only"
    admin = {"Authorization": f"Bearer {keys.admin}"}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=admin)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'fresh_r8' added successfully."
    # fingerprinted and on record before any request named it
    fp = adapter_fingerprint(live.audit_url, "fresh_r8")
    assert not query(live.audit_url, select(REQUESTS).where(REQUESTS.c.adapter_fingerprint == fp))
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=admin).status_code == 400  # already loaded
    with openai_client(live, keys.globex) as globex:  # "*_r8" covers it
        r = globex.completions.create(model="fresh_r8", prompt="x", max_tokens=2)
    assert r.system_fingerprint == fp
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "fresh_r8"}, headers=admin)
    assert r.status_code == 200 and "removed" in r.text
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "fresh_r8"}, headers=admin).status_code == 404
    with openai_client(live, keys.globex) as globex, pytest.raises(openai.NotFoundError):
        globex.completions.create(model="fresh_r8", prompt="x", max_tokens=2)
    r = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": "/no/such/folder"}, headers=admin
    )
    assert r.status_code == 404 and "adapter" in _error(r)["message"]  # vLLM's status for a folder not there


def test_tokenize_and_detokenize(live, keys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(live.tiny.model_dir)
    h = {"Authorization": f"Bearer {keys.acme}"}
    r = httpx.post(f"{live.base_url}/tokenize", json={"model": BASE, "prompt": "hello world"}, headers=h).json()
    assert r["tokens"] == tok.encode("hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    chat = httpx.post(f"{live.base_url}/tokenize", json={"model": "qv_r4", "messages": CHAT}, headers=h).json()
    assert chat["tokens"] == tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    back = httpx.post(f"{live.base_url}/detokenize", json={"model": BASE, "tokens": r["tokens"]}, headers=h).json()
    assert back["prompt"] == tok.decode(r["tokens"])
    assert (
        httpx.post(f"{live.base_url}/tokenize", json={"model": "all_r8", "prompt": "x"}, headers=h).status_code == 403
    )


def test_health_version_and_metrics_in_vllms_names(live, client):
    assert httpx.get(f"{live.base_url}/health").status_code == 200
    from loraledger.version import __version__

    assert httpx.get(f"{live.base_url}/version").json() == {"version": __version__}
    client.completions.create(model="qv_r4", prompt="x", max_tokens=2)
    families = {f.name: f for f in text_string_to_metric_families(_scrape(live))}
    [info] = families["vllm:lora_requests_info"].samples
    assert (
        set(info.labels) == {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}
        and info.labels["max_lora"] == "2"
    )
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        [sample] = families[name].samples
        assert sample.labels == {"model_name": BASE} and sample.value >= 0
    ok = {
        s.labels["adapter"]: s.value for s in families["loraledger_requests"].samples if s.labels.get("outcome") == "ok"
    }
    assert ok["qv_r4"] >= 1
    assert any(s.labels == {"adapter": "qv_r4", "where": "host"} for s in families["loraledger_adapter_loads"].samples)
    assert any(
        s.labels == {"adapter": "qv_r4", "where": "device"} for s in families["loraledger_adapter_loads"].samples
    )
    ttft = {
        s.labels["adapter"]: s.value
        for s in families["loraledger_time_to_first_token_seconds"].samples
        if s.name.endswith("_count")
    }
    assert ttft["qv_r4"] >= 1
    assert "loraledger_e2e_request_latency_seconds" in families and "loraledger_generation_tokens" in families
    for name in ("loraledger_audit_queue_depth", "loraledger_audit_write_failures", "loraledger_audit_store_up"):
        assert name in families


def test_a_client_gone_mid_stream_aborts_its_request_on_record(live, keys):
    body = {
        "model": "qv_r4",
        "prompt": "tell me a long story",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream(
            "POST", f"{live.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {keys.acme}"}
        ) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            rid = json.loads(first[6:])["id"]
            next(lines)
        # the connection is closed here, long before 200 tokens
    deadline = time.monotonic() + 30
    while not events(live.audit_url, EventKind.REQUEST_ABORTED, rid):
        assert time.monotonic() < deadline, "the abandoned request was not recorded as aborted"
        time.sleep(0.05)
    [row] = completions(live.audit_url, rid)
    assert row.finish_reason == "abort" and 1 <= row.generated_token_count < 200


def test_every_greedy_output_equals_llm_generate_and_the_log_verifies(live, client, keys):
    from loraledger import LLM, LoRARequest, SamplingParams

    prompts = ["the quick brown fox", "SELECT name FROM", "once upon a time"]
    models = [BASE, "qv_r4"]
    served = {
        (m, p): client.completions.create(model=m, prompt=p, max_tokens=8, temperature=0).choices[0].text
        for m in models
        for p in prompts
    }
    chats = {
        m: client.chat.completions.create(model=m, messages=CHAT, max_tokens=8, temperature=0)
        .choices[0]
        .message.content
        for m in models
    }
    tiny = live.tiny
    qv = LoRARequest("qv_r4", 1, str(tiny.adapters["qv_r4"]))
    with LLM(
        model=str(tiny.model_dir), enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4, audit_url=None
    ) as llm:
        params = SamplingParams(temperature=0, max_tokens=8)
        for m in models:
            lora = qv if m == "qv_r4" else None
            outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
            assert [o.outputs[0].text for o in outs] == [served[(m, p)] for p in prompts], m
            [chat] = llm.chat(CHAT, params, lora_request=lora, use_tqdm=False)
            assert chat.outputs[0].text == chats[m]
    with AuditLog(live.audit_url) as log:
        result = log.verify()
    assert result.ok, result.problems


def _scrape(live) -> str:
    """/metrics, with a key: a server with keys shows its metrics to key holders only."""
    return httpx.get(f"{live.base_url}/metrics", headers={"Authorization": f"Bearer {live.scrape_key}"}).text


def _metric(live, family: str) -> dict:
    text = _scrape(live)
    out = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name == family:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_load_inplace_reloads_a_loaded_adapter_from_its_new_folder(live, keys):
    """vLLM's load_inplace on /v1/load_lora_adapter: an adapter already loaded is read again (here from another folder,
    as a training loop writes a new checkpoint), and requests admitted from then on run on the new content."""
    from loraledger.lora.checkpoint_reader import fingerprint_adapter

    url, admin = live.base_url, {"Authorization": f"Bearer {keys.admin}"}
    first, second = str(live.tiny.adapters["all_r8"]), str(live.tiny.adapters["ogd_r16_rslora"])
    assert (
        httpx.post(
            f"{url}/v1/load_lora_adapter", json={"lora_name": "inplace_r8", "lora_path": first}, headers=admin
        ).status_code
        == 200
    )
    with openai_client(live, keys.globex) as globex:  # "*_r8" covers it
        assert globex.completions.create(
            model="inplace_r8", prompt="x", max_tokens=2
        ).system_fingerprint == fingerprint_adapter(first)
        body = {"lora_name": "inplace_r8", "lora_path": second, "load_inplace": True}
        r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=admin)
        assert r.status_code == 200, r.text
        assert globex.completions.create(
            model="inplace_r8", prompt="x", max_tokens=2
        ).system_fingerprint == fingerprint_adapter(second)
        assert globex.completions.create(
            model="inplace_r8", prompt="y", max_tokens=2
        ).system_fingerprint == fingerprint_adapter(second)
    assert (
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "inplace_r8"}, headers=admin).status_code == 200
    )
