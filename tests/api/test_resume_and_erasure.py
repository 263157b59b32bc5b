"""A request interrupted by a crash and re-run by recovery: its completion carries the tool calls the first run would
have recorded (the binding says how they are read), and one whose text was erased in between is not re-run: it gets
no new text, whichever way the erasure and the resumption interleave (SQLite and PostgreSQL)."""

from __future__ import annotations

import msgspec
import pytest
from sqlalchemy import select

from loraledger import AsyncEngine, EngineArgs, SamplingParams
from loraledger import recovery as recovery_module
from loraledger.audit import AuditLog
from loraledger.audit.erase import erase
from loraledger.digests import binding_digest
from loraledger.errors import RequestErasedError
from loraledger.sampling_params import StructuredOutputsParams
from loraledger.store import texts
from loraledger.store.audit_store import EVENTS, REQUESTS, AuditStore
from loraledger.store.db import write_transaction
from loraledger.store.records import AuditBatch, EventKind, EventRecord, salted_content, salted_text, text_commitments
from loraledger.store.rows import request_record
from loraledger.tool_calls import ToolCallSpec

TOOLS = [
    {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
]
WROTE = '<tool_call>{"name": "weather", "arguments": {"city": "oslo"}}</tool_call>'
PARAMS = SamplingParams(
    temperature=0,
    max_tokens=120,
    structured_outputs=StructuredOutputsParams(regex=WROTE.replace("{", r"\{").replace("}", r"\}")),
)
SPEC = ToolCallSpec(tools=TOOLS, mode="auto", parser="hermes", parallel=True)


def _args(model_dir, url: str, *, resume: bool) -> EngineArgs:
    return EngineArgs(
        model=str(model_dir), block_size=4, audit_url=url, audit_prompts="text", resume_interrupted=resume
    )


async def _run_once(model_dir, url: str) -> str:
    """One request with tools and a constraint, run to the end: its audit key."""
    async with AsyncEngine(_args(model_dir, url, resume=False)) as engine:
        channel = await engine.submit("first", "what is the weather in oslo?", PARAMS, tool_calls=SPEC)
        async with channel:
            async for delivery in channel:
                if delivery.item.finished:
                    return delivery.item.audit_id
    raise AssertionError("the request did not finish")


def _crashed_copy(url: str, source: str, rid: str) -> None:
    """A request admitted under source's binding and never ended, owned by no instance: what an engine that crashed
    mid-request leaves (the next engine's recovery interrupts it at start and, with resume_interrupted, re-runs it)."""
    with AuditStore(url) as store:
        with store.engine.connect() as conn:
            binding = request_record(conn.execute(select(REQUESTS).where(REQUESTS.c.request_id == source)).one())
            kept = texts.stored(conn, [source])
        rows, fields = [], {}
        prompt = kept[(source, texts.PROMPT, 0)]
        row = salted_text(rid, texts.PROMPT, 0, prompt.text, prompt.token_ids)
        rows.append(row)
        fields["prompt_commitment"], fields["prompt_token_ids_commitment"] = text_commitments(row)
        for part, name in ((texts.TOOLS, "tools_commitment"), (texts.CONSTRAINT, "constraint_commitment")):
            row, fields[name] = salted_content(rid, part, 0, kept[(source, part, 0)].text)
            rows.append(row)
        copy = msgspec.structs.replace(binding, request_id=rid, caller_request_id=rid, **fields)
        payload = {"binding": msgspec.to_builtins(copy), "binding_sha256": binding_digest(copy)}
        event = EventRecord(
            kind=EventKind.REQUEST_ADMITTED,
            at=copy.received_at,
            request_id=rid,
            payload=payload,
            dedup_key=f"admit:{rid}",
        )
        store.write(AuditBatch(requests=[copy], events=[event], texts=rows))


def _erase(url: str, rid: str) -> None:
    with AuditStore(url) as store, write_transaction(store.engine) as conn:
        assert erase(conn, request_id=rid, reason="the data subject asked").requests == 1


def _state(url: str, rid: str):
    with AuditStore(url) as store, store.engine.connect() as conn:
        kinds = [
            (row.kind, row.payload)
            for row in conn.execute(
                select(EVENTS.c.kind, EVENTS.c.payload).where(EVENTS.c.request_id == rid).order_by(EVENTS.c.seq)
            )
        ]
        return kinds, texts.stored(conn, [rid])


async def test_a_resumed_request_records_the_tool_calls_an_uninterrupted_run_records(db_url, tiny_llama):
    first = await _run_once(tiny_llama.model_dir, db_url)
    _crashed_copy(db_url, first, "crashed-1")
    async with AsyncEngine(_args(tiny_llama.model_dir, db_url, resume=True)) as engine:
        resumed = await engine.wait_resumed()
    assert resumed["crashed-1"].finished, resumed
    kinds, kept = _state(db_url, "crashed-1")
    assert [k for k, _ in kinds][-2:] == [EventKind.REQUEST_RESUMED, EventKind.REQUEST_FINISHED]
    assert dict(kinds)[EventKind.REQUEST_RESUMED] == {}  # nothing it could not read
    _, first_kept = _state(db_url, first)
    calls = kept[("crashed-1", texts.TOOL_CALLS, 0)].text
    assert (
        calls == first_kept[(first, texts.TOOL_CALLS, 0)].text == ('[{"arguments":{"city":"oslo"},"name":"weather"}]')
    )
    with AuditLog(db_url) as log:
        result = log.verify()
        shown = log.request("crashed-1").completions[0]
    assert result.ok, result.problems
    assert shown.tool_calls == calls


async def test_a_binding_that_does_not_say_how_calls_are_read_is_resumed_with_that_on_record(
    db_url, tiny_llama, monkeypatch
):
    """A binding from before tool_reading (revision 0016): the resumed completion has no calls, and its
    request_resumed event says why."""
    first = await _run_once(tiny_llama.model_dir, db_url)
    _crashed_copy(db_url, first, "crashed-old")
    real = recovery_module._tool_calls

    def as_before(record, tools_text):
        return real(msgspec.structs.replace(record, tool_reading=None), tools_text)

    monkeypatch.setattr(recovery_module, "_tool_calls", as_before)
    async with AsyncEngine(_args(tiny_llama.model_dir, db_url, resume=True)) as engine:
        resumed = await engine.wait_resumed()
    assert resumed["crashed-old"].finished
    kinds, kept = _state(db_url, "crashed-old")
    assert "revision 0016" in dict(kinds)[EventKind.REQUEST_RESUMED]["tool_calls_not_read"]
    assert ("crashed-old", texts.TOOL_CALLS, 0) not in kept


@pytest.mark.parametrize("when", ["before_resume_reads", "before_resume_is_recorded"])
async def test_a_request_erased_after_its_interruption_is_not_resumed_and_gets_no_new_text(
    db_url, tiny_llama, when, monkeypatch
):
    first = await _run_once(tiny_llama.model_dir, db_url)
    _crashed_copy(db_url, first, "crashed-2")
    real = texts.kept_for_resume

    def erase_in_between(store, request_ids):
        # recovery has recorded the request as interrupted (ended): an erasure may come now, before or after it reads
        if when == "before_resume_reads":
            _erase(db_url, "crashed-2")
            return real(store, request_ids)
        found = real(store, request_ids)
        _erase(db_url, "crashed-2")
        return found

    monkeypatch.setattr(texts, "kept_for_resume", erase_in_between)
    async with AsyncEngine(_args(tiny_llama.model_dir, db_url, resume=True)) as engine:
        resumed = await engine.wait_resumed()
    assert isinstance(resumed["crashed-2"], RequestErasedError), resumed
    kinds, kept = _state(db_url, "crashed-2")
    assert kept == {}, "an erased request kept new text"
    names = [k for k, _ in kinds]
    assert EventKind.REQUEST_RESUMED not in names and EventKind.REQUEST_FINISHED not in names
    if when == "before_resume_is_recorded":  # admission tried, and the refusal is on record
        assert "erased" in dict(kinds)[EventKind.RESUME_REFUSED]
    with AuditLog(db_url) as log:
        result = log.verify()
    assert result.ok, result.problems
    assert result.erased_texts == 3  # its prompt, tools and constraint


def test_the_store_refuses_text_for_an_erased_request_and_its_resumption(db_url):
    from tests.audit.salted import salted_batch

    with AuditStore(db_url) as store:
        store.write(salted_batch("gone", at=1_764_000_000.0, tenant="t"))
    _erase(db_url, "gone")
    late = salted_text("gone", texts.COMPLETION, 7, "new text", [1])
    resumed = EventRecord(
        kind=EventKind.REQUEST_RESUMED, at=1_764_000_100.0, request_id="gone", dedup_key="resumed:gone"
    )
    with AuditStore(db_url) as store:
        with pytest.raises(RequestErasedError, match="'gone' was erased"):
            store.write(AuditBatch(events=[resumed]))
        with pytest.raises(Exception, match="erased"):  # the database's guard, before the writer's own check
            store.write(AuditBatch(texts=[late]))
        with store.engine.connect() as conn:
            assert texts.stored(conn, ["gone"]) == {}
    with AuditLog(db_url) as log:
        assert log.verify().ok
