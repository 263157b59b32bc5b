"""generate_many: many requests admitted together, then their final outputs awaited together (LLM.generate's core)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from loraledger.audit_ids import new_audit_id
from loraledger.errors import EngineDeadError

if TYPE_CHECKING:
    from loraledger.engine_client import EngineClient
    from loraledger.lora.request import LoRARequest
    from loraledger.outputs import RequestOutput
    from loraledger.sampling_params import SamplingParams


async def generate_many(
    engine: EngineClient,
    requests: list[tuple[str, object, SamplingParams, LoRARequest | None, str | None]],
    *,
    on_finished=None,
    chat_template_sha256: list[str | None] | None = None,
) -> list[RequestOutput]:
    """Admit every request first (a refused one raises before any output is awaited, and the rest are aborted),
    then wait for all final outputs, returned in the given order. on_finished(output) is called as each
    request finishes (a progress bar); chat_template_sha256: per request, the template that rendered it."""
    n = len(requests)
    channels: list[MemoryObjectReceiveStream | None] = [None] * n
    errors: list[BaseException | None] = [None] * n
    audit_ids = [new_audit_id() for _ in range(n)]

    async def admit(i: int) -> None:
        rid, prompt, params, lora, tenant = requests[i]
        sha = chat_template_sha256[i] if chat_template_sha256 is not None else None
        try:
            channels[i] = await engine.submit(
                rid, prompt, params, lora, tenant=tenant, chat_template_sha256=sha, audit_id=audit_ids[i]
            )
        except Exception as exc:  # reported below, in prompt order
            errors[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(admit, i)
    first_error = next((e for e in errors if e is not None), None)
    if first_error is not None:
        await engine.abort_audit_ids([audit_ids[i] for i in range(n) if channels[i] is not None])
        for channel in channels:
            if channel is not None:
                channel.close()
        raise first_error

    results: list[RequestOutput | None] = [None] * n

    async def collect(i: int) -> None:
        async with channels[i] as channel:
            async for delivery in channel:
                item = delivery.item
                if isinstance(item, BaseException):
                    errors[i] = item
                    return
                if item.finished:
                    results[i] = item
                    if on_finished is not None:
                        on_finished(item)
                    return
        errors[i] = EngineDeadError(f"the engine stopped before request {requests[i][0]!r} finished")

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(collect, i)
    first_error = next((e for e in errors if e is not None), None)
    if first_error is not None:
        raise first_error
    return results  # type: ignore[return-value]
