"""The engine's own appends to the audit log (adapters loaded by add_lora, access_denied events): send, await the commit."""

from __future__ import annotations

import time

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectSendStream

from loraledger.actors.messages import AuditAppend
from loraledger.errors import AuditUnavailableError
from loraledger.store.records import EventKind, EventRecord, recordable


async def append_and_wait(audit: MemoryObjectSendStream, msg: AuditAppend, what: str, limit: float) -> None:
    """Send records to the audit writer's inbox and wait until they are committed (or refused: its error is raised);
    AuditUnavailableError naming `what` when that takes longer than `limit` seconds."""
    send, receive = anyio.create_memory_object_stream[object](1)
    await audit.send(msgspec.structs.replace(msg, reply=send))
    async with receive:
        with anyio.move_on_after(limit):
            outcome = await receive.receive()
            if outcome is not None:
                raise outcome
            return
    raise AuditUnavailableError(
        f"{what}, but the audit store did not commit its record within {limit:g} s; it is held and retried"
    )


def access_denied_event(
    tenant: str | None, key_id: str | None, adapter: str, route: str, caller_request_id: str | None
) -> EventRecord:
    """The access_denied event: who (tenant, key id) asked for which model on which route; no request, no binding."""
    payload = {"tenant": tenant, "key_id": key_id, "adapter": adapter, "route": route}
    if caller_request_id is not None:
        payload["caller_request_id"] = caller_request_id
    payload = {k: recordable(v) if isinstance(v, str) else v for k, v in payload.items()}
    return EventRecord(kind=EventKind.ACCESS_DENIED, at=time.time(), payload=payload)
