"""Crash recovery at engine start: requests admitted but never finished are put on record as interrupted, and optionally re-run.

It assumes one engine writes to an audit database at a time: a second engine starting on the
same database would take the first one's in-flight requests for interrupted ones.
"""

from __future__ import annotations

import time

import anyio
import msgspec

from loraledger.errors import LoraLedgerError
from loraledger.lora_request import LoRARequest
from loraledger.sampling_params import SamplingParams
from loraledger.store.records import EventKind
from loraledger.structured_outputs import from_canonical

# the dedup keys keep a retried start from writing these events twice
INTERRUPTED_KEY = "interrupted:{}"


async def record_interrupted(engine) -> list:
    """Write an `interrupted` event for every unfinished request, and one `engine_recovered` event."""
    from loraledger.actors.messages import AuditAppend
    from loraledger.store.records import EventRecord

    store = engine._live().setup.store
    unfinished = await anyio.to_thread.run_sync(store.unfinished_requests)
    if not unfinished:
        return []
    now = time.time()
    events = [
        EventRecord(
            kind=EventKind.REQUEST_INTERRUPTED,
            at=now,
            request_id=r.request_id,
            payload={"reason": "the engine stopped before the request finished (killed, crashed, or stopped while its audit store did not answer)"},
            dedup_key=INTERRUPTED_KEY.format(r.request_id),
        )
        for r in unfinished
    ]
    events.append(
        EventRecord(kind=EventKind.ENGINE_RECOVERED, at=now, payload={"interrupted": [r.request_id for r in unfinished], "resume": engine.args.resume_interrupted})
    )
    await _append(engine, AuditAppend(events=events))
    return unfinished


async def _append(engine, msg) -> None:
    send, receive = anyio.create_memory_object_stream[object](1)
    async with engine._live().sender("audit") as audit:
        await audit.send(msgspec.structs.replace(msg, reply=send))
    async with receive:
        outcome = await receive.receive()
    if outcome is not None:
        raise outcome


async def resume(engine, unfinished: list, results: dict, done: anyio.Event) -> None:
    """Re-run interrupted requests under their original binding; each outcome (final output or error) lands in `results`,
    keyed by the request's audit key (RequestOutput.audit_id; its request_id is the caller's id, as first submitted)."""
    store = engine._live().setup.store
    payloads = await anyio.to_thread.run_sync(store.admitted_payloads, [r.request_id for r in unfinished])

    async def one(record) -> None:
        rid = record.request_id
        try:
            await run(record)
        except Exception as exc:  # one request that cannot be resumed is that request's outcome, not the engine's
            results[rid] = exc if isinstance(exc, LoraLedgerError) else LoraLedgerError(f"request {rid!r} cannot be resumed: {type(exc).__name__}: {exc}")

    async def run(record) -> None:
        rid = record.request_id
        payload = payloads.get(rid) or {}
        prompt_ids = payload.get("prompt_token_ids")
        if prompt_ids is None:
            results[rid] = LoraLedgerError(f"request {rid!r} cannot be resumed: its prompt was not kept (audit_prompts != 'text')")
            return
        lora = None
        if record.lora_int_id is not None:
            lora = LoRARequest(record.lora_name, record.lora_int_id, record.lora_path)
        params = msgspec.convert(record.sampling_params, SamplingParams, str_keys=True)  # logit_bias keys come back as JSON str
        if record.constraint_kind is not None:
            if record.constraint_text is None:
                results[rid] = LoraLedgerError(f"request {rid!r} cannot be resumed: its constraint's text was not kept (audit_prompts != 'text')")
                return
            params = msgspec.structs.replace(params, structured_outputs=from_canonical(record.constraint_text))
        channel = await engine.submit(
            record.caller_request_id or rid,  # a binding from before revision 0006: its key was the caller's id
            {"prompt_token_ids": prompt_ids},
            params,
            lora,
            tenant=record.tenant,
            resume=True,
            bound_fingerprint=record.adapter_fingerprint,
            audit_id=rid,  # it runs under the binding on record, keyed as it was
        )
        async with channel:
            async for delivery in channel:
                if isinstance(delivery.item, BaseException) or delivery.item.finished:
                    results[rid] = delivery.item
                    return

    try:
        async with anyio.create_task_group() as tg:
            for record in unfinished:
                tg.start_soon(one, record)
    finally:
        done.set()
