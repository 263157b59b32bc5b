"""AuditWriter actor, driven through its inbox with an in-memory store: group commits, acknowledgements once
durable, duplicates refused, admissions refused while the store is down (fail closed) and held records committed
once it is back."""

from __future__ import annotations

import threading

import anyio
import pytest

from loraledger.actors.audit_writer import AuditWriter
from loraledger.actors.messages import AuditAppend, AuditCommitted, Shutdown
from loraledger.errors import AuditUnavailableError, DuplicateRequestError
from loraledger.store.records import AuditBatch, EventRecord, RequestRecord

pytestmark = pytest.mark.anyio


class MemoryStore:
    """The two store operations the writer uses; `down` makes writes fail before anything is committed, and
    `gate` (when set) holds each write until the test releases it."""

    def __init__(self) -> None:
        self.batches: list[AuditBatch] = []
        self.down = False
        self.gate: threading.Event | None = None
        self.writing = threading.Event()

    def existing_request_ids(self, ids: list[str]) -> set[str]:
        return {r.request_id for b in self.batches for r in b.requests} & set(ids)

    def write(self, batch: AuditBatch) -> None:
        self.writing.set()
        if self.gate is not None:
            assert self.gate.wait(10), "the test never released the write"
        if self.down:
            exc = AuditUnavailableError("the audit store is unreachable")
            exc.maybe_committed = False  # type: ignore[attr-defined]
            raise exc
        self.batches.append(batch)


def binding(rid: str) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        adapter_fingerprint=None,
        lora_name=None,
        lora_int_id=None,
        lora_path=None,
        tenant=None,
        sampling_params={},
        prompt_text=None,
        prompt_sha256=None,
        prompt_token_count=1,
        received_at=1.0,
        engine_version="test",
        base_model_fingerprint="0" * 64,
    )


def event(rid: str) -> EventRecord:
    return EventRecord(kind="finished", at=2.0, request_id=rid)


class Harness:
    def __init__(self, store: MemoryStore, **kwargs) -> None:
        self.inbox, inbox_rx = anyio.create_memory_object_stream(64)
        assembler_tx, self.assembler = anyio.create_memory_object_stream(64)
        self.writer = AuditWriter(inbox_rx, assembler_tx, store, retry_initial=0.01, retry_max=0.05, **kwargs)

    async def append(self, **fields):
        """Send one AuditAppend; returns the receiving end of its reply."""
        reply_tx, reply_rx = anyio.create_memory_object_stream(1)
        await self.inbox.send(AuditAppend(reply=reply_tx, **fields))
        return reply_rx


async def outcome(reply_rx) -> object:
    with anyio.fail_after(10):
        async with reply_rx:
            return await reply_rx.receive()


async def test_records_that_arrive_during_a_commit_share_the_next_one_and_are_acknowledged_once_durable():
    store = MemoryStore()
    store.gate = threading.Event()
    h = Harness(store)
    async with anyio.create_task_group() as tg:
        await tg.start(h.writer.run)
        first = await h.append(requests=[binding("r0")], admission=True)
        with anyio.fail_after(10):
            while not store.writing.is_set():
                await anyio.sleep(0.005)
        later = [await h.append(events=[event(f"r{i}")], commit_notify=[f"r{i}"]) for i in range(1, 4)]
        store.gate.set()
        assert await outcome(first) is None
        assert [await outcome(r) for r in later] == [None, None, None]
        notified = []
        with anyio.fail_after(10):
            while len(notified) < 3:
                msg = await h.assembler.receive()
                assert isinstance(msg, AuditCommitted)
                notified += msg.audit_ids
        await h.inbox.send(Shutdown())
    assert sorted(notified) == ["r1", "r2", "r3"]
    assert [len(b.requests) + len(b.events) for b in store.batches] == [1, 3], "the three waiting records: one commit"
    assert h.writer.stats.commits == 2


async def test_an_audit_key_already_on_record_is_refused_and_the_rest_of_its_group_commits():
    store = MemoryStore()
    h = Harness(store)
    async with anyio.create_task_group() as tg:
        await tg.start(h.writer.run)
        assert await outcome(await h.append(requests=[binding("dup")], admission=True)) is None
        again = await h.append(requests=[binding("dup")], admission=True)
        fresh = await h.append(requests=[binding("new")], admission=True)
        assert isinstance(await outcome(again), DuplicateRequestError)
        assert await outcome(fresh) is None
        await h.inbox.send(Shutdown())
    assert [r.request_id for b in store.batches for r in b.requests] == ["dup", "new"]


async def test_while_the_store_is_down_admissions_are_refused_and_held_records_commit_once_it_is_back():
    store = MemoryStore()
    store.down = True
    h = Harness(store, on_failure="reject")
    async with anyio.create_task_group() as tg:
        await tg.start(h.writer.run)
        held = await h.append(events=[event("r1")], commit_notify=["r1"])
        with anyio.fail_after(10):
            while not h.writer.stats.store_down:
                await anyio.sleep(0.005)
        refused = await h.append(requests=[binding("r2")], admission=True)
        error = await outcome(refused)
        assert isinstance(error, AuditUnavailableError) and "audit_on_failure='block'" in str(error)
        assert h.writer.stats.held == 1
        store.down = False
        assert await outcome(held) is None
        with anyio.fail_after(10):
            committed = await h.assembler.receive()
        await h.inbox.send(Shutdown())
    assert isinstance(committed, AuditCommitted) and committed.audit_ids == ["r1"]
    assert [e.request_id for b in store.batches for e in b.events] == ["r1"]
    assert not store.existing_request_ids(["r2"]), "a refused admission is not on record"
    assert h.writer.stats.failures >= 1 and not h.writer.stats.store_down
