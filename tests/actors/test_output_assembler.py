"""OutputAssembler actor, driven through its inbox: a request's completions go to the audit writer when it ends,
its final output reaches the caller only once they are durable (AuditCommitted), and a refusal by the database
ends it with the error instead of the output."""

from __future__ import annotations

import anyio
import pytest

from loraledger.actors.messages import (
    AuditAppend,
    AuditCommitted,
    AuditRefused,
    Delivery,
    RequestDone,
    SeqUpdate,
    Shutdown,
    StepTokens,
    TrackRequest,
)
from loraledger.actors.output_assembler import OutputAssembler
from loraledger.errors import AuditUnavailableError
from loraledger.outputs import RequestOutput
from loraledger.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.anyio


class Harness:
    def __init__(self) -> None:
        self.inbox, inbox_rx = anyio.create_memory_object_stream(16)
        scheduler_tx, self.scheduler = anyio.create_memory_object_stream(16)
        admission_tx, self.admission = anyio.create_memory_object_stream(16)
        audit_tx, self.audit = anyio.create_memory_object_stream(16)
        self.caller_tx, self.caller = anyio.create_memory_object_stream(16)
        self.assembler = OutputAssembler(inbox_rx, scheduler_tx, admission_tx, audit_tx, durable=True)

    async def finish_one(self, rid: str) -> AuditAppend:
        """Track a request, give it two tokens (the second ends it) and return what went to the audit writer."""
        params = SamplingParams(max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY)
        await self.inbox.send(
            TrackRequest(
                audit_id=rid,
                prompt=None,
                prompt_token_ids=[1, 2, 3],
                params=params,
                lora_request=None,
                adapter_fingerprint=None,
                arrival_time=1.0,
                queued_time=1.0,
                channel=self.caller_tx,
            )
        )
        await self.inbox.send(StepTokens(updates=[SeqUpdate(rid, 0, [5], [-0.5])], time=2.0))
        await self.inbox.send(StepTokens(updates=[SeqUpdate(rid, 0, [6], [-0.25], finish_reason="length")], time=3.0))
        with anyio.fail_after(10):
            return await self.audit.receive()


def nothing_waiting(stream) -> bool:
    try:
        stream.receive_nowait()
    except anyio.WouldBlock:
        return True
    return False


async def test_a_final_output_reaches_the_caller_only_once_its_rows_are_durable():
    h = Harness()
    async with anyio.create_task_group() as tg:
        await tg.start(h.assembler.run)
        append = await h.finish_one("a1")
        assert append.commit_notify == ["a1"]
        assert [(c.request_id, c.token_ids, c.finish_reason) for c in append.completions] == [("a1", [], "length")]
        # the token ids (and text) travel as salted text, the row only commits to them
        assert [(t.request_id, t.part, t.token_ids) for t in append.texts] == [("a1", "completion", [5, 6])]
        assert [e.request_id for e in append.events] == ["a1"]
        await anyio.sleep(0.05)
        assert nothing_waiting(h.caller), "the output went out before its completion rows were committed"
        await h.inbox.send(AuditCommitted(audit_ids=["a1"]))
        with anyio.fail_after(10):
            delivery = await h.caller.receive()
            done = await h.admission.receive()
        await h.inbox.send(Shutdown())
    assert isinstance(delivery, Delivery) and isinstance(delivery.item, RequestOutput)
    assert delivery.item.finished and delivery.item.outputs[0].token_ids == [5, 6]
    assert isinstance(done, RequestDone) and done.audit_id == "a1"


async def test_rows_the_database_refuses_end_the_request_with_the_error_not_the_output():
    h = Harness()
    async with anyio.create_task_group() as tg:
        await tg.start(h.assembler.run)
        await h.finish_one("a2")
        error = AuditUnavailableError("the database refused the rows")
        await h.inbox.send(AuditRefused(audit_ids=["a2"], error=error))
        with anyio.fail_after(10):
            delivery = await h.caller.receive()
        await h.inbox.send(Shutdown())
    assert isinstance(delivery, Delivery) and isinstance(delivery.item, BaseException)
    assert "refused" in str(delivery.item)
