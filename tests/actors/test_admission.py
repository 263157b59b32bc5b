"""Admission actor, driven through its inbox: a request is handed on (caller, OutputAssembler, Scheduler) only once
its binding is on record, a refused binding or a bad token id ends it with a typed error and queues nothing, and a
caller id held by a live request is refused until that request is done."""

from __future__ import annotations

import anyio
import pytest

from loraledger.actors.admission import Admission
from loraledger.actors.messages import (
    Accepted,
    AuditAppend,
    Delivery,
    NewRequest,
    RequestDone,
    Shutdown,
    Submit,
    TrackRequest,
)
from loraledger.errors import AuditUnavailableError, DuplicateRequestError, LoraLedgerError
from loraledger.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio
VOCAB = 100


class Harness:
    def __init__(self, *, audit: bool) -> None:
        self.inbox, inbox_rx = anyio.create_memory_object_stream(16)
        loader_tx, _ = anyio.create_memory_object_stream(16)
        scheduler_tx, self.scheduler = anyio.create_memory_object_stream(16)
        assembler_tx, self.assembler = anyio.create_memory_object_stream(16)
        audit_tx, self.audit = anyio.create_memory_object_stream(16) if audit else (None, None)
        self.admission = Admission(
            inbox_rx,
            loader_tx,
            scheduler_tx,
            assembler_tx,
            audit_tx,
            tokenizers=None,
            vocab_size=VOCAB,
            max_model_len=64,
            enable_lora=False,
            audit_prompts="none",
            base_model_fingerprint="0" * 64,
        )

    async def submit(self, rid: str, token_ids: list[int], caller: str | None = None):
        """Submit a token prompt; returns the caller's end of its delivery channel."""
        tx, rx = anyio.create_memory_object_stream(8)
        await self.inbox.send(
            Submit(
                request_id=rid,
                prompt=None,
                prompt_token_ids=token_ids,
                params=SamplingParams(max_tokens=4),
                lora_request=None,
                tenant=None,
                arrival_time=1.0,
                channel=tx,
                caller_request_id=caller,
            )
        )
        return rx


async def delivered(rx) -> object:
    with anyio.fail_after(10):
        msg = await rx.receive()
    assert isinstance(msg, Delivery)
    return msg.item


def nothing_waiting(stream) -> bool:
    try:
        stream.receive_nowait()
    except (anyio.WouldBlock, anyio.EndOfStream):  # empty, or empty and closed (the actor stopped)
        return True
    return False


async def test_a_request_is_handed_on_only_once_its_binding_is_on_record():
    h = Harness(audit=True)
    async with anyio.create_task_group() as tg:
        await tg.start(h.admission.run)
        caller = await h.submit("k1", [3, 4, 5], caller="mine")
        with anyio.fail_after(10):
            binding = await h.audit.receive()
        assert isinstance(binding, AuditAppend) and binding.admission
        assert [(r.request_id, r.caller_request_id, r.prompt_token_count) for r in binding.requests] == [
            ("k1", "mine", 3)
        ]
        await anyio.sleep(0.05)
        assert nothing_waiting(h.scheduler) and nothing_waiting(h.assembler) and nothing_waiting(caller)
        async with binding.reply:
            await binding.reply.send(None)  # committed
        accepted = await delivered(caller)
        with anyio.fail_after(10):
            tracked = await h.assembler.receive()
            queued = await h.scheduler.receive()
        await h.inbox.send(Shutdown())
    assert isinstance(accepted, Accepted) and accepted.request_id == "k1"
    assert isinstance(tracked, TrackRequest) and tracked.caller_request_id == "mine"
    assert isinstance(queued, NewRequest) and queued.audit_id == "k1" and queued.prompt_token_ids == [3, 4, 5]


async def test_a_refused_binding_or_a_token_past_the_vocabulary_ends_the_request_and_queues_nothing():
    h = Harness(audit=True)
    async with anyio.create_task_group() as tg:
        await tg.start(h.admission.run)
        refused = await h.submit("k2", [1, 2])
        with anyio.fail_after(10):
            binding = await h.audit.receive()
        async with binding.reply:
            await binding.reply.send(AuditUnavailableError("the audit store is unreachable"))
        assert isinstance(await delivered(refused), AuditUnavailableError)
        bad = await h.submit("k3", [1, VOCAB])
        error = await delivered(bad)
        await anyio.sleep(0.05)
        await h.inbox.send(Shutdown())
    assert isinstance(error, LoraLedgerError) and str(VOCAB) in str(error)
    assert nothing_waiting(h.scheduler) and nothing_waiting(h.assembler)
    assert nothing_waiting(h.audit), "a request the model checks refuse is not put on record"


async def test_a_caller_id_held_by_a_live_request_is_refused_until_that_request_is_done():
    h = Harness(audit=False)
    async with anyio.create_task_group() as tg:
        await tg.start(h.admission.run)
        first = await h.submit("k4", [1], caller="same")
        assert isinstance(await delivered(first), Accepted)
        clash = await h.submit("k5", [1], caller="same")
        assert isinstance(await delivered(clash), DuplicateRequestError)
        await h.inbox.send(RequestDone(audit_id="k4"))
        again = await h.submit("k6", [1], caller="same")
        assert isinstance(await delivered(again), Accepted)
        await h.inbox.send(Shutdown())
