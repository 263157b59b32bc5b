"""Erasure of a tenant whose requests had tools and a constraint: the tool definitions, the constraint's text and the
tool calls (with their arguments) go with the prompt and completion text, so no copy of them is left in any column
of any table or view (SQLite and PostgreSQL); readers say "erased", verify passes, receipts still prove the text."""

from __future__ import annotations

import json

from sqlalchemy import JSON, String, Text, select, text

from loraledger import AsyncEngine, EngineArgs, SamplingParams
from loraledger.audit import AuditLog
from loraledger.audit.signing import generate_ed25519_key
from loraledger.evidence import receipt
from loraledger.evidence.receipt import Receipt
from loraledger.sampling_params import StructuredOutputsParams
from loraledger.store import texts
from loraledger.store.db import make_engine
from loraledger.store.models import Base, Event
from loraledger.store.records import EventKind
from loraledger.tool_calls import ToolCallSpec
from tests.evidence.test_commands import run

MARKER = "zq7marker"  # in the prompt, the tool definitions, the constraint, the output and the call's arguments
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": f"finds {MARKER}-tools", "parameters": {}}}]
WROTE = f'<tool_call>{{"name": "lookup", "arguments": {{"who": "{MARKER}-arg"}}}}</tool_call>'
PARAMS = SamplingParams(
    temperature=0,
    max_tokens=120,
    structured_outputs=StructuredOutputsParams(regex=WROTE.replace("{", r"\{").replace("}", r"\}")),
)
E = Event.__table__


async def _serve(model_dir, url: str, key: str):
    """acme: two requests with tools, a constraint and a call; bob: one plain request. Their final outputs."""
    args = EngineArgs(model=str(model_dir), block_size=4, audit_url=url, audit_prompts="text", log_key_file=key)
    spec = ToolCallSpec(tools=TOOLS, mode="auto", parser="hermes")
    outs = {}
    async with AsyncEngine(args) as engine:
        for caller, prompt, tenant, params, tools in (
            ("a1", f"call lookup for {MARKER}-prompt", "acme", PARAMS, spec),
            ("a2", f"again {MARKER}-prompt", "acme", PARAMS, spec),
            ("b1", "bob asks", "bob", SamplingParams(temperature=0, max_tokens=4), None),
        ):
            channel = await engine.submit(caller, prompt, params, tenant=tenant, tool_calls=tools)
            async with channel:
                async for delivery in channel:
                    if delivery.item.finished:
                        outs[caller] = delivery.item
                        break
    return outs


def _every_text_value(url: str) -> str:
    """Every text and JSON column of every table (and every view) as one string."""
    engine = make_engine(url)
    found = []
    try:
        with engine.connect() as conn:
            for table in Base.metadata.sorted_tables:
                cols = [c for c in table.c if isinstance(c.type, (String, Text, JSON))]
                for row in conn.execute(select(*cols)):
                    found.extend(json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else v for v in row)
            for view in ("request_lineage", "adapter_usage"):
                for row in conn.execute(text(f"SELECT * FROM {view}")):
                    found.extend(str(v) for v in row)
    finally:
        engine.dispose()
    return "\n".join(found)


async def test_erasing_a_tenant_with_tools_leaves_no_copy_of_its_content(db_url, tiny_llama, tmp_path, capsys):
    generate_ed25519_key(tmp_path / "log.pem")
    outs = await _serve(tiny_llama.model_dir, db_url, str(tmp_path / "log.pem"))
    acme = [outs["a1"], outs["a2"]]
    assert all(MARKER in o.outputs[0].text for o in acme)
    before = _every_text_value(db_url)
    for piece in ("-prompt", "-tools", "-arg"):
        assert MARKER + piece in before  # kept, until erased
    with AuditLog(db_url) as log:
        assert log.verify().ok
        shown = log.request(acme[0].audit_id)
    assert MARKER in shown.binding.tools_text and MARKER in shown.binding.constraint_text
    assert json.loads(shown.completions[0].tool_calls) == [{"arguments": {"who": f"{MARKER}-arg"}, "name": "lookup"}]

    code, out = run(capsys, "audit", "erase", "--tenant", "acme", "--reason", "GDPR Art. 17", "--url", db_url)
    assert code == 0 and "erased the text of 2 request(s)" in out, out
    after = _every_text_value(db_url)
    assert MARKER not in after, [line for line in after.splitlines() if MARKER in line][:5]
    assert "bob asks" in after  # bob's text stays

    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            (event,) = conn.execute(select(E).where(E.c.kind == EventKind.ERASED)).all()
            left = texts.stored(conn, [o.audit_id for o in acme])
    finally:
        engine.dispose()
    assert left == {}
    counts = {k: event.payload[k] for k in ("requests", "prompts", "completions", "tools", "constraints", "tool_calls")}
    assert counts == {"requests": 2, "prompts": 2, "completions": 2, "tools": 2, "constraints": 2, "tool_calls": 2}

    code, out = run(capsys, "audit", "verify", "--url", db_url)
    assert code == 0 and "10 text rows erased, each on record" in out, out
    code, out = run(capsys, "audit", "show", acme[0].audit_id, "--url", db_url)
    erased = f"(erased, event {event.seq})"
    assert code == 0 and MARKER not in out
    assert out.count(erased) == 5, out  # the prompt, the constraint, the tools, the completion, its calls
    assert f"tool calls {erased}" in out

    report = tmp_path / "report"
    code, out = run(capsys, "audit", "report", "--since", "2020-01-01", "--until", "2100-01-01", "--out", str(report),
                    "--format", "jsonl", "--unsigned", "--url", db_url)  # fmt: skip
    assert code == 0, out
    rows = [json.loads(line) for line in (report / "requests.jsonl").read_text().splitlines()]
    calls = [json.loads(line) for line in (report / "completions.jsonl").read_text().splitlines()]
    acme_ids = {o.audit_id for o in acme}
    assert all(r["tools_text"] is None and r["constraint_text"] is None for r in rows if r["request_id"] in acme_ids)
    assert all(c["tool_calls"] is None and c["text"] is None for c in calls if c["request_id"] in acme_ids)
    assert MARKER not in (report / "requests.jsonl").read_text() + (report / "completions.jsonl").read_text()

    # the receipt holder still proves its text, tool call included: the receipt signs the text's digest
    held = Receipt(**acme[0].receipt)
    (tmp_path / "r.json").write_bytes(receipt.dumps(held))
    (tmp_path / "text.txt").write_text(acme[0].outputs[0].text, encoding="utf-8")
    code, out = run(capsys, "audit", "verify-receipt", str(tmp_path / "r.json"), "--text", str(tmp_path / "text.txt"))
    assert code == 0 and "text OK" in out, out
