"""The request fields beyond sampling that OpenAI's and vLLM's clients send, and the response shapes vLLM's clients
read: each field either does what it means here (request_id, cache_salt, documents, reasoning_effort, the legacy
functions), is refused because it would change the answer (modalities beyond text), or is ignored and named in the
Warning header (verbosity, prediction, kv_transfer_params, ...)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.model_fixtures import TinyModel, with_chat_template
from tests.server.audit_rows import binding
from tests.server.conftest import BASE, server_config
from tests.server.live import LiveServer

# a retrieval-augmented template in the usual shape: documents and the reasoning effort before the turns
RAG_TEMPLATE = (
    "{{ bos_token }}{% if documents %}{% for d in documents %}<|doc|> {{ d['title'] }}: {{ d['text'] }}{% endfor %}"
    "{% endif %}{% if reasoning_effort %}<|effort|> {{ reasoning_effort }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT = [{"role": "user", "content": "weather in oslo?"}]
CLOCK = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
FUNCTIONS = [{"name": "clock", "description": "the time", "parameters": CLOCK}]


@pytest.fixture(scope="module")
def rag(tiny_llama, tmp_path_factory):
    model_dir = with_chat_template(tiny_llama.model_dir, tmp_path_factory.mktemp("rag") / "model", RAG_TEMPLATE)
    tiny = TinyModel(arch="llama", model_dir=model_dir, adapters=tiny_llama.adapters, config=tiny_llama.config)
    tmp = tmp_path_factory.mktemp("server")
    with LiveServer(server_config(tiny, tmp, None, insecure_no_auth=True)) as server:
        server.audit_url = f"sqlite:///{tmp / 'audit.db'}"
        server.tiny = tiny
        yield server


def _post(server, route: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(f"{server.base_url}{route}", json=body, headers=headers, timeout=60)


def _rendered(server, messages) -> str:
    """The text a conversation renders to, as /tokenize shows it."""
    r = _post(server, "/tokenize", {"model": BASE, "messages": messages, "return_token_strs": True})
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.tiny.model_dir).decode(r.json()["tokens"])


def _chat(server, **fields) -> httpx.Response:
    return _post(server, "/v1/chat/completions", {"model": BASE, "messages": CHAT, "max_tokens": 3, **fields})


def test_harmless_fields_are_ignored_and_named_in_a_warning_header(rag):
    plain = _chat(rag, temperature=0)
    assert plain.status_code == 200 and "warning" not in plain.headers
    extra = {"verbosity": "low", "prediction": {"type": "content", "content": "x"}, "kv_transfer_params": {}}
    r = _chat(rag, store=False, temperature=0, **extra)
    assert r.status_code == 200, r.text
    warning = r.headers["warning"]
    assert warning.startswith("299 loraledger ") and all(f in warning for f in ("store", *extra)), warning
    assert r.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
    c = _post(rag, "/v1/completions", {"model": BASE, "prompt": "hi", "max_tokens": 2, "kv_transfer_params": {}})
    assert c.status_code == 200 and "kv_transfer_params" in c.headers["warning"]
    streamed = _chat(rag, stream=True, verbosity="high")
    assert streamed.status_code == 200 and "verbosity" in streamed.headers["warning"]
    assert streamed.text.rstrip().endswith("data: [DONE]")


def test_the_body_request_id_is_the_caller_id_unless_the_header_gives_one(rag):
    r = _chat(rag, request_id="job-body-1")
    assert r.status_code == 200, r.text
    assert binding(rag.audit_url, r.json()["id"]).caller_request_id == "job-body-1"
    both = _post(
        rag, "/v1/completions", {"model": BASE, "prompt": "hi", "max_tokens": 2, "request_id": "from-body"},
        **{"X-Request-Id": "from-header"},
    )  # fmt: skip
    assert both.status_code == 200 and both.headers["x-request-id"] == "from-header"
    assert binding(rag.audit_url, both.json()["id"]).caller_request_id == "from-header"
    bad = _chat(rag, request_id="a\nb")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"


def test_legacy_functions_are_served_as_tools_and_answered_as_a_function_call(rag):
    r = _chat(rag, functions=FUNCTIONS, function_call={"name": "clock"}, max_tokens=60, temperature=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "function_call"
    call = choice["message"]["function_call"]
    assert call["name"] == "clock" and choice["message"]["tool_calls"][0]["function"] == call
    jsonschema.validate(json.loads(call["arguments"]), CLOCK)
    # a legacy conversation: the assistant's function_call and the function's result render as tool turns
    turns = [*CHAT, {"role": "assistant", "content": None, "function_call": call},
             {"role": "function", "name": "clock", "content": "12:00"}]  # fmt: skip
    legacy = _post(rag, "/v1/chat/completions", {"model": BASE, "messages": turns, "max_tokens": 2})
    assert legacy.status_code == 200, legacy.text
    as_tools = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                "function": call}]}, {"role": "tool", "name": "clock", "content": "12:00"}]  # fmt: skip
    same = _post(rag, "/v1/chat/completions", {"model": BASE, "messages": as_tools, "max_tokens": 2})
    # rendered as the tool turns they stand for: the same prompt, byte for byte
    digests = {binding(rag.audit_url, r.json()["id"]).prompt_sha256 for r in (legacy, same)}
    assert len(digests) == 1 and None not in digests
    assert "<|tool|> 12:00" in _rendered(rag, as_tools)
    both = _chat(rag, functions=FUNCTIONS, tools=[{"type": "function", "function": FUNCTIONS[0]}])
    assert both.status_code == 400 and "not both" in both.json()["error"]["message"]


def test_documents_and_reasoning_effort_reach_the_chat_template(rag):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rag.tiny.model_dir)
    docs = [{"title": "fjords", "text": "oslo lies at the end of one"}]
    r = _chat(rag, documents=docs, reasoning_effort="low")
    assert r.status_code == 200, r.text
    text = tokenizer.apply_chat_template(
        CHAT, documents=docs, reasoning_effort="low", tokenize=False, add_generation_prompt=True
    )
    assert "<|doc|> fjords" in text and "<|effort|> low" in text
    assert r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))
    assert r.json()["usage"]["prompt_tokens"] > _chat(rag).json()["usage"]["prompt_tokens"]
    bad = _chat(rag, documents=["not a dict"])
    assert bad.status_code == 400, bad.text


def test_modalities_other_than_text_are_refused(rag):
    assert _chat(rag, modalities=["text"]).status_code == 200
    r = _chat(rag, modalities=["text", "audio"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "modalities", r.text


def test_cache_salt_is_accepted_on_both_routes_and_an_empty_one_refused(rag):
    # that a salt keeps requests off each other's cached blocks is checked on the engine, where the cache is
    # visible: tests/api/test_scheduling.py
    assert _chat(rag, cache_salt="tenant-a").status_code == 200
    body = {"model": BASE, "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2, "cache_salt": "tenant-a"}
    assert _post(rag, "/v1/completions", body).status_code == 200
    r = _chat(rag, cache_salt="")
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_the_fields_vllm_sends_as_null_are_there(rag):
    chat = _chat(rag).json()
    assert {k: chat[k] for k in ("service_tier", "kv_transfer_params", "prompt_token_ids")} == dict.fromkeys(
        ("service_tier", "kv_transfer_params", "prompt_token_ids")
    )
    message = chat["choices"][0]["message"]
    assert all(message[k] is None for k in ("reasoning", "annotations", "audio", "function_call"))
    assert message["tool_calls"] == [] and chat["choices"][0]["token_ids"] is None
    assert chat["usage"]["prompt_tokens_details"] is None
    text = _post(rag, "/v1/completions", {"model": BASE, "prompt": "hi", "max_tokens": 2}).json()
    assert text["choices"][0]["prompt_token_ids"] is None and text["choices"][0]["token_ids"] is None
    assert text["kv_transfer_params"] is None and text["usage"]["prompt_tokens_details"] is None


def test_errors_name_the_parameter(rag):
    for body, param in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"n": 0}, "n"),
        ({"model": "nope"}, "model"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ]:
        r = _post(rag, "/v1/completions", {"model": BASE, "prompt": "hi", "max_tokens": 2, **body})
        error = r.json()["error"]
        assert r.status_code in (400, 404) and error["param"] == param, (body, r.text)
        assert isinstance(error["code"], str) and error["type"] in ("invalid_request_error",), r.text


def test_model_cards_carry_vllms_permission_object(rag):
    cards = httpx.get(f"{rag.base_url}/v1/models", timeout=30).json()["data"]
    for card in cards:
        (permission,) = card["permission"]
        assert permission["object"] == "model_permission" and permission["allow_sampling"] is True
        assert httpx.get(f"{rag.base_url}/v1/models/{card['id']}", timeout=30).json() == card
    adapter = next(c for c in cards if c["parent"] is not None)
    assert adapter["max_model_len"] == next(c for c in cards if c["id"] == BASE)["max_model_len"]


def test_loading_an_adapter_from_a_missing_folder_is_404_naming_lora_path(live, keys, tmp_path):
    admin = {"Authorization": f"Bearer {keys.admin}"}
    body = {"lora_name": "ghost", "lora_path": str(tmp_path / "nowhere")}
    r = _post(live, "/v1/load_lora_adapter", body, **admin)
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path", r.text
    listed = httpx.get(f"{live.base_url}/v1/models", headers=admin, timeout=30).json()["data"]
    assert "ghost" not in {c["id"] for c in listed}
