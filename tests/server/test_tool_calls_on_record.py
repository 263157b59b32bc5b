"""Tool calls on record: a request with tools is bound to their definitions (tools_sha256 always, their text where
audit_prompts is "text", kept apart under a salt) and to how its calls are read (tool_reading); each completion commits
to the calls read from its text (canonical JSON, kept apart under a salt), forced or auto,
streamed or not, on chat and on the Responses API; `verify` finds a forged digest or forged calls, `audit show`
prints both."""

from __future__ import annotations

import hashlib
import json

import openai
import pytest
from sqlalchemy import select, text

from loraledger.audit import AuditLog
from loraledger.audit.lineage_text import format_lineage
from loraledger.digests import canonical_json, text_commitment
from loraledger.store import texts
from loraledger.store.audit_store import COMPLETIONS, REQUESTS, AuditStore
from loraledger.store.guards import guards_for
from loraledger.tool_calls import ToolCallSpec, calls_of
from tests.audit.tampering import tamper
from tests.server.conftest import BASE, server_config
from tests.server.live import LiveServer
from tests.server.test_forced_tool_calls import CHAT, TIME, TOOLS

WROTE = (
    'Now: <tool_call>{"name": "clock", "arguments": {"zone": "utc"}}</tool_call>'
    '<tool_call>{"name": "weather", "arguments": {"city": "oslo", "unit": "c"}}</tool_call>'
)
TOOL_NAMES = [t["function"]["name"] for t in TOOLS]
REGEX = {"regex": WROTE.replace("{", r"\{").replace("}", r"\}")}


def _rows(url: str):
    with AuditStore(url) as store, store.engine.connect() as conn:
        requests = {r.request_id: r for r in conn.execute(select(REQUESTS))}
        completions = {r.request_id: r for r in conn.execute(select(COMPLETIONS))}
        kept = texts.stored(conn, requests)
    return requests, completions, kept


def _calls(completion, kept) -> str | None:
    """A completion's calls as kept apart (revision 0016 on), checked against the row's commitment."""
    row = kept.get((completion.request_id, texts.TOOL_CALLS, completion.completion_index))
    assert completion.tool_calls is None, "the calls belong in `request_texts` alone"
    if row is None:
        assert completion.tool_calls_commitment is None
        return None
    assert completion.tool_calls_commitment == text_commitment(row.salt, row.text) and row.token_ids == []
    return row.text


@pytest.mark.parametrize("policy", ["text", "hash"])
def test_tools_and_calls_are_on_record_and_verified(tiny_llama_chat, tmp_path, policy):
    config = server_config(
        tiny_llama_chat, tmp_path, None, insecure_no_auth=True, enable_auto_tool_choice=True, tool_call_parser="hermes",
        engine={"audit_prompts": policy},
    )  # fmt: skip
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    named = {"type": "function", "function": {"name": "clock"}}
    with LiveServer(config) as live:
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0, timeout=60)
        forced = client.chat.completions.create(
            model="qv_r4", messages=CHAT, tools=TOOLS, tool_choice=named, max_completion_tokens=160, temperature=0
        )
        streamed = list(client.chat.completions.create(
            model=BASE, messages=CHAT, tools=TOOLS, max_tokens=400, temperature=0, stream=True,
            extra_body={"structured_outputs": REGEX},
        ))  # fmt: skip
        one = client.chat.completions.create(
            model=BASE, messages=CHAT, tools=TOOLS, max_tokens=400, temperature=0, parallel_tool_calls=False,
            extra_body={"structured_outputs": REGEX},
        )  # fmt: skip
        response = client.responses.create(
            model="qv_r4", input="time?", max_output_tokens=160, temperature=0,
            tools=[{"type": "function", "name": "clock", "parameters": TIME}], tool_choice={"type": "function", "name": "clock"},
        )  # fmt: skip
        plain = client.chat.completions.create(model=BASE, messages=CHAT, max_tokens=4, temperature=0)
    requests, completions, kept = _rows(url)
    tools_text = canonical_json(TOOLS).decode()
    sha = hashlib.sha256(tools_text.encode()).hexdigest()

    call = forced.choices[0].message.tool_calls[0]
    assert requests[forced.id].tools_sha256 == sha
    # the definitions are kept where prompts are, apart under a salt so that erasure removes them
    assert requests[forced.id].tools_text is None
    kept_tools = kept.get((forced.id, texts.TOOLS, 0))
    if policy == "text":
        assert kept_tools.text == tools_text
        assert requests[forced.id].tools_commitment == text_commitment(kept_tools.salt, tools_text)
    else:
        assert kept_tools is None and requests[forced.id].tools_commitment is None
    # how the calls are read is on record, so a resumed request reads them the same way
    assert requests[forced.id].tool_reading == {
        "mode": "named",
        "parser": None,
        "parallel": True,
        "name_index": TOOL_NAMES.index("clock"),
    }
    assert requests[one.id].tool_reading == {"mode": "auto", "parser": "hermes", "parallel": False, "name_index": None}
    want = [{"name": "clock", "arguments": json.loads(call.function.arguments)}]
    assert _calls(completions[forced.id], kept) == canonical_json(want).decode()

    two = [
        {"name": "clock", "arguments": {"zone": "utc"}},
        {"name": "weather", "arguments": {"city": "oslo", "unit": "c"}},
    ]
    assert _calls(completions[streamed[0].id], kept) == canonical_json(two).decode()
    assert _calls(completions[one.id], kept) == canonical_json(two[:1]).decode()
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["clock"]
    # an auditor recomputes the calls from the row's text and the request's tool_choice
    spec = ToolCallSpec(tools=TOOLS, mode="auto", parser="hermes", parallel=False)
    with AuditLog(url) as log, log.snapshot() as conn:  # the completion's text, kept apart under its salt
        one_text = conn.execute(
            text("SELECT text FROM request_texts WHERE request_id = :r AND part = 'completion' AND idx = 0"),
            {"r": completions[one.id].request_id},
        ).scalar_one()
    assert canonical_json(calls_of(spec, one_text)).decode() == _calls(completions[one.id], kept)

    flat = [{"type": "function", "function": {"name": "clock", "parameters": TIME}}]
    assert requests[response.id].tools_sha256 == hashlib.sha256(canonical_json(flat)).hexdigest()
    response_calls = json.loads(_calls(completions[response.id], kept))
    assert response_calls[0]["arguments"] == json.loads(response.output[0].arguments)
    assert requests[plain.id].tools_sha256 is None and _calls(completions[plain.id], kept) is None
    assert requests[plain.id].tool_reading is None

    with AuditLog(url) as log:
        assert log.verify().ok
        shown = format_lineage(log.request(forced.id))
    assert f"tools         sha256 {sha}" in shown and f"tool calls {_calls(completions[forced.id], kept)}" in shown
    assert (tools_text in shown) == (policy == "text")

    with AuditStore(url) as store, store.engine.begin() as conn:  # guards out of the way, as an intruder would
        for guard in guards_for("sqlite"):
            conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {guard.name}")
        conn.execute(
            text("UPDATE requests SET tools_sha256 = :h WHERE request_id = :r"), {"h": "e" * 64, "r": forced.id}
        )
    with AuditLog(url) as log:
        result = log.verify()
    assert not result.ok and "tools_sha256" in result.first_problem.message
    forged = canonical_json([{"name": "weather", "arguments": {"city": "rome", "unit": "c"}}]).decode()
    tamper(
        url,
        "UPDATE requests SET tools_sha256 = :h WHERE request_id = :f",
        "UPDATE request_texts SET text = :c WHERE request_id = :o AND part = 'tool_calls'",
        h=sha, f=forced.id, c=forged, o=one.id,
    )  # fmt: skip
    with AuditLog(url) as log:
        result = log.verify()
    assert not result.ok and one.id in result.first_problem.message and "tool calls" in result.first_problem.message
    assert result.first_problem.table == "request_texts"
    assert result.first_problem.key == {"request_id": one.id, "part": "tool_calls", "idx": 0}


def test_tools_without_a_canonical_form_are_a_400(live, keys):
    import httpx

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "default": float("nan")}}}]
    body = {"model": BASE, "messages": CHAT, "tools": tools, "max_tokens": 2}
    r = httpx.post(
        f"{live.base_url}/v1/chat/completions", content=json.dumps(body), timeout=60,
        headers={"Authorization": f"Bearer {keys.acme}", "Content-Type": "application/json"},
    )  # fmt: skip
    assert r.status_code == 400 and "canonical" in r.json()["error"]["message"], r.text
