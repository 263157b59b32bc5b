"""AdapterLoader: one load per adapter whatever the askers, the host cache's evictions on record, and pinning end to
end on one PinLora message (load if need be, hold in host memory, have the Scheduler keep a device slot)."""

from __future__ import annotations

import shutil
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import pytest

from loraledger.actors.adapter_loader import AdapterLoader
from loraledger.actors.messages import (
    AdapterResolved,
    AddLora,
    AuditAppend,
    ListLoras,
    PinLora,
    PinSlot,
    RemoveLora,
    ResolveAdapter,
    Shutdown,
    UnpinSlot,
)
from loraledger.errors import (
    AdapterNotFoundError,
    LoRARequestConflictError,
    RequestFailedError,
    TooManyLoRAsError,
    UnknownRequestError,
)
from loraledger.lora.request import LoRARequest
from loraledger.store.records import EventKind


@dataclass
class Harness:
    inbox: anyio.abc.ObjectSendStream
    loader: AdapterLoader
    to_scheduler: list = field(default_factory=list)
    events: list = field(default_factory=list)
    slot_answer: object = True  # what the stand-in Scheduler answers a PinSlot with

    async def ask(self, make):
        send, receive = anyio.create_memory_object_stream[object](1)
        await self.inbox.send(make(send))
        async with receive:
            return await receive.receive()

    async def resolve(self, lora: LoRARequest) -> AdapterResolved:
        return await self.ask(lambda reply: ResolveAdapter(lora_request=lora, reply=reply))

    def kinds(self) -> list[tuple[str, str]]:
        return [(e.kind, e.payload["name"]) for e in self.events]


@asynccontextmanager
async def running_loader(tiny_llama, *, max_cpu_loras: int, max_loras: int):
    inbox_send, inbox = anyio.create_memory_object_stream[object](16)
    audit_send, audit = anyio.create_memory_object_stream[object](64)
    scheduler_send, scheduler = anyio.create_memory_object_stream[object](16)
    loader = AdapterLoader(
        inbox,
        audit_send,
        scheduler_send,
        model_config=tiny_llama.config,
        max_lora_rank=16,
        max_cpu_loras=max_cpu_loras,
        max_loras=max_loras,
        base_model_fingerprint="base",
    )
    h = Harness(inbox_send, loader)

    async def scheduler_stand_in():
        async for msg in scheduler:
            h.to_scheduler.append(msg)
            if isinstance(msg, PinSlot):
                async with msg.reply:
                    await msg.reply.send(h.slot_answer)

    async def audit_stand_in():
        async for msg in audit:
            assert isinstance(msg, AuditAppend)
            h.events += msg.events

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(scheduler_stand_in)
            tg.start_soon(audit_stand_in)
            await tg.start(loader.run)
            try:
                yield h
            finally:
                await inbox_send.send(Shutdown())
                await anyio.wait_all_tasks_blocked()
                tg.cancel_scope.cancel()


def _lora(tiny_llama, name: str, int_id: int, path=None) -> LoRARequest:
    return LoRARequest(name, int_id, str(path or tiny_llama.adapters[name]))


async def test_concurrent_askers_share_one_load_and_later_ones_hit_the_cache(tiny_llama):
    async with running_loader(tiny_llama, max_cpu_loras=2, max_loras=1) as h:
        lora = _lora(tiny_llama, "qv_r4", 1)
        answers = []

        async def ask():
            answers.append(await h.resolve(lora))

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(ask)
        again = await h.resolve(lora)
        ckpts = {id(a.checkpoint) for a in [*answers, again]}
        assert len(ckpts) == 1 and again.error is None and again.checkpoint.name == "qv_r4"
        assert h.loader.stats.loads["qv_r4"] == 1
        assert h.kinds() == [(EventKind.ADAPTER_LOADED, "qv_r4")]
        assert await h.ask(lambda reply: ListLoras(reply=reply)) == [1]


async def test_the_least_recently_used_adapter_leaves_the_host_cache_on_record(tiny_llama):
    names = list(tiny_llama.adapters)[:3]
    async with running_loader(tiny_llama, max_cpu_loras=2, max_loras=1) as h:
        for i, name in enumerate(names, start=1):
            assert (await h.resolve(_lora(tiny_llama, name, i))).error is None
        await anyio.wait_all_tasks_blocked()
        assert (EventKind.ADAPTER_EVICTED, names[0]) in h.kinds()
        assert h.loader.stats.evictions == {names[0]: 1}
        await h.resolve(_lora(tiny_llama, names[0], 1))  # read again from disk
        assert h.loader.stats.loads[names[0]] == 2


async def test_a_conflicting_registration_is_the_askers_error(tiny_llama):
    a, b = list(tiny_llama.adapters)[:2]
    async with running_loader(tiny_llama, max_cpu_loras=2, max_loras=1) as h:
        await h.resolve(_lora(tiny_llama, a, 1))
        got = await h.ask(
            lambda reply: AddLora(lora_request=_lora(tiny_llama, b, 1, tiny_llama.adapters[b]), reply=reply)
        )
        assert isinstance(got.error, LoRARequestConflictError) and got.checkpoint is None


async def test_pin_loads_an_evicted_adapter_then_has_the_scheduler_hold_its_slot(tiny_llama):
    a, b = list(tiny_llama.adapters)[:2]
    async with running_loader(tiny_llama, max_cpu_loras=1, max_loras=1) as h:
        await h.resolve(_lora(tiny_llama, a, 1))
        await h.resolve(_lora(tiny_llama, b, 2))  # capacity 1: a leaves the host cache
        assert await h.ask(lambda reply: PinLora(lora_int_id=1, reply=reply)) is True
        assert h.loader.stats.loads[a] == 2  # read again for the pin
        (pin,) = [m for m in h.to_scheduler if isinstance(m, PinSlot)]
        assert pin.checkpoint.name == a and pin.fingerprint == pin.checkpoint.fingerprint
        # pinned: b's next load cannot push it out, b itself is not kept
        await h.resolve(_lora(tiny_llama, b, 2))
        again = await h.resolve(_lora(tiny_llama, a, 1))
        assert again.checkpoint is pin.checkpoint and h.loader.stats.loads[a] == 2
        # pinning again needs no new pin, and no new load
        assert await h.ask(lambda reply: PinLora(lora_int_id=1, reply=reply)) is True
        assert h.loader.stats.loads[a] == 2
        # removing it frees its device slot
        assert await h.ask(lambda reply: RemoveLora(lora_int_id=1, reply=reply)) is True
        await anyio.wait_all_tasks_blocked()
        assert UnpinSlot(fingerprint=pin.fingerprint) in h.to_scheduler
        assert await h.ask(lambda reply: RemoveLora(lora_int_id=1, reply=reply)) is False


async def test_pin_refuses_an_unknown_id_and_more_pins_than_slots(tiny_llama):
    a, b = list(tiny_llama.adapters)[:2]
    async with running_loader(tiny_llama, max_cpu_loras=2, max_loras=1) as h:
        got = await h.ask(lambda reply: PinLora(lora_int_id=9, reply=reply))
        assert isinstance(got, UnknownRequestError) and "add_lora() it first" in str(got)
        await h.resolve(_lora(tiny_llama, a, 1))
        await h.resolve(_lora(tiny_llama, b, 2))
        assert await h.ask(lambda reply: PinLora(lora_int_id=1, reply=reply)) is True
        got = await h.ask(lambda reply: PinLora(lora_int_id=2, reply=reply))
        assert isinstance(got, TooManyLoRAsError) and "max_loras=1" in str(got)
        assert sum(isinstance(m, PinSlot) for m in h.to_scheduler) == 1


async def test_a_pin_whose_load_fails_is_the_callers_error_and_holds_nothing(tiny_llama, tmp_path):
    a, b = list(tiny_llama.adapters)[:2]
    moved = shutil.copytree(tiny_llama.adapters[a], tmp_path / a)
    async with running_loader(tiny_llama, max_cpu_loras=1, max_loras=1) as h:
        await h.resolve(_lora(tiny_llama, a, 1, moved))
        await h.resolve(_lora(tiny_llama, b, 2))  # a leaves the host cache
        shutil.rmtree(moved)
        got = await h.ask(lambda reply: PinLora(lora_int_id=1, reply=reply))
        assert isinstance(got, AdapterNotFoundError) and got.lora_name == a
        assert not any(isinstance(m, PinSlot) for m in h.to_scheduler)
        assert await h.ask(lambda reply: ListLoras(reply=reply)) == [2]  # the failed adapter is forgotten
        assert await h.ask(lambda reply: PinLora(lora_int_id=2, reply=reply)) is True  # its pin did not stay


async def test_a_pin_the_scheduler_refuses_is_undone(tiny_llama):
    a, b = list(tiny_llama.adapters)[:2]
    async with running_loader(tiny_llama, max_cpu_loras=2, max_loras=1) as h:
        await h.resolve(_lora(tiny_llama, a, 1))
        await h.resolve(_lora(tiny_llama, b, 2))
        h.slot_answer = RequestFailedError("the scheduler could not take it")
        got = await h.ask(lambda reply: PinLora(lora_int_id=1, reply=reply))
        assert isinstance(got, RequestFailedError)
        h.slot_answer = True
        assert await h.ask(lambda reply: PinLora(lora_int_id=2, reply=reply)) is True  # the one pin is free again


@pytest.mark.parametrize("resumed_id", [1, 7])
async def test_a_resumed_request_gets_the_local_id_of_its_adapter(tiny_llama, resumed_id):
    a = next(iter(tiny_llama.adapters))
    async with running_loader(tiny_llama, max_cpu_loras=1, max_loras=1) as h:
        await h.resolve(_lora(tiny_llama, a, 3))
        lora = _lora(tiny_llama, a, resumed_id)
        got = await h.ask(lambda reply: ResolveAdapter(lora_request=lora, reply=reply, resumed=True))
        assert got.lora_request.lora_int_id == 3 and got.error is None
