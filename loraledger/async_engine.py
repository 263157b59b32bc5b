"""AsyncEngine: the asyncio/trio-friendly engine (`async with AsyncEngine.from_engine_args(args) as engine`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from loraledger.actors.engine_core import EngineCore
from loraledger.actors.messages import (
    Abort,
    Accepted,
    AddLora,
    AdapterResolved,
    Delivery,
    GetStats,
    ListLoras,
    PinLora,
    PinSlot,
    RemoveLora,
    ResolveAdapter,
    Submit,
)
from loraledger.engine_args import EngineArgs
from loraledger.errors import EngineDeadError, LoRADisabledError
from loraledger.lora_request import LoRARequest
from loraledger.outputs import RequestOutput
from loraledger.prompts import parse_prompt
from loraledger.sampling_params import SamplingParams


class AsyncEngine:
    """One engine: the actors run in this event loop's task group for as long as the `async with` lasts."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self._core: EngineCore | None = None
        self._stack: AsyncExitStack | None = None
        self._tg = None
        self._admission: MemoryObjectSendStream | None = None
        self.interrupted: list[str] = []  # request ids found unfinished in the audit log at start
        self.resumed: dict[str, object] = {}  # with resume_interrupted: request id -> final RequestOutput or error
        self._resume_done = anyio.Event()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncEngine":
        return cls(args)

    # --- life cycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> "AsyncEngine":
        from loraledger.engine_setup import prepare

        setup = await anyio.to_thread.run_sync(prepare, self.args)
        self._stack = AsyncExitStack()
        try:
            self._tg = await self._stack.enter_async_context(anyio.create_task_group())
            self._core = EngineCore(setup)
            await self._core.start(self._tg)
        except BaseException:
            await self._stack.aclose()
            _close_store(setup.store)
            raise
        self._admission = self._core.sender("admission")
        if setup.store is not None:
            await self._recover()
        return self

    async def _recover(self) -> None:
        from loraledger.recovery import record_interrupted, resume

        unfinished = await record_interrupted(self)
        self.interrupted = [r.request_id for r in unfinished]
        if unfinished and self.args.resume_interrupted:
            self._tg.start_soon(resume, self, unfinished, self.resumed, self._resume_done)
        else:
            self._resume_done.set()

    async def wait_resumed(self) -> dict[str, object]:
        """Wait until every resumed request has its outcome (final RequestOutput or error) in `resumed`."""
        await self._resume_done.wait()
        return self.resumed

    async def __aexit__(self, *exc_info) -> bool | None:
        core, stack = self._core, self._stack
        if core is None or stack is None:
            return None
        try:
            if self._admission is not None:
                self._admission.close()
            await core.stop()
        finally:
            self._core = None
            try:
                return await stack.__aexit__(*exc_info)
            finally:
                _close_store(core.setup.store)

    @property
    def tokenizer(self):
        return self._live().setup.tokenizer

    @property
    def model_config(self):
        return self._live().setup.model_config

    @property
    def max_model_len(self) -> int:
        return self._live().setup.max_model_len

    @property
    def base_model_fingerprint(self) -> str:
        return self._live().setup.base_model_fingerprint

    def _live(self) -> EngineCore:
        if self._core is None:
            raise EngineDeadError("the engine is not running; use it inside `async with AsyncEngine.from_engine_args(args) as engine:`")
        return self._core

    # --- requests -----------------------------------------------------------------------------

    def new_request_id(self) -> str:
        """Globally unique (the audit log outlives this process)."""
        return uuid.uuid4().hex

    def _channel_size(self, params: SamplingParams) -> int:
        # a request delivers at most one item per generated token, plus acceptance and the final
        return (params.max_tokens or self.max_model_len) + 8

    async def submit(
        self,
        request_id: str,
        prompt: object,
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        *,
        tenant: str | None = None,
        arrival_time: float | None = None,
        resume: bool = False,
        bound_fingerprint: str | None = None,
    ) -> MemoryObjectReceiveStream:
        """Admit one request; returns its output channel once the request is accepted, or raises why not."""
        self._live()
        text, ids = parse_prompt(prompt)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
        if lora_request is not None and not self.args.enable_lora:
            raise LoRADisabledError(
                f"request {request_id!r} names adapter {lora_request.lora_name!r} but the engine was built with enable_lora=False; "
                "pass enable_lora=True to serve adapters"
            )
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        send, receive = anyio.create_memory_object_stream[Delivery](self._channel_size(params))
        msg = Submit(
            request_id=str(request_id),
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            lora_request=lora_request,
            tenant=tenant,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            channel=send,
            resume=resume,
            bound_fingerprint=bound_fingerprint,
        )
        try:
            await self._admission.send(msg)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise EngineDeadError("the engine has stopped and takes no new requests") from exc
        first = await receive.receive()
        if isinstance(first.item, BaseException):
            receive.close()
            raise first.item
        assert isinstance(first.item, Accepted)
        return receive

    async def generate(
        self,
        prompt: object,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        *,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (per its output_kind); stopping early aborts the request."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        rid = request_id if request_id is not None else self.new_request_id()
        channel = await self.submit(rid, prompt, params, lora_request, tenant=tenant)
        finished = False
        try:
            async with channel:
                async for delivery in channel:
                    item = delivery.item
                    if isinstance(item, BaseException):
                        finished = True
                        raise item
                    if item.finished:
                        finished = True
                    yield item
                    if finished:
                        return
            if not finished:
                raise EngineDeadError(f"the engine stopped before request {rid!r} finished")
        finally:
            if not finished and self._core is not None:
                with anyio.CancelScope(shield=True):
                    await self.abort(rid)

    async def generate_many(self, requests: list[tuple[str, object, SamplingParams, LoRARequest | None, str | None]]) -> list[RequestOutput]:
        """Admit every request first (a refused one raises before any output is awaited, and the rest are aborted),
        then wait for all final outputs, returned in the given order."""
        n = len(requests)
        channels: list[MemoryObjectReceiveStream | None] = [None] * n
        errors: list[BaseException | None] = [None] * n

        async def admit(i: int) -> None:
            rid, prompt, params, lora, tenant = requests[i]
            try:
                channels[i] = await self.submit(rid, prompt, params, lora, tenant=tenant)
            except Exception as exc:  # reported below, in prompt order
                errors[i] = exc

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(admit, i)
        first_error = next((e for e in errors if e is not None), None)
        if first_error is not None:
            admitted = [requests[i][0] for i in range(n) if channels[i] is not None]
            await self.abort(admitted)
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
                        return
            errors[i] = EngineDeadError(f"the engine stopped before request {requests[i][0]!r} finished")

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(collect, i)
        first_error = next((e for e in errors if e is not None), None)
        if first_error is not None:
            raise first_error
        return results  # type: ignore[return-value]

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        try:
            await self._admission.send(Abort(request_ids=ids))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass

    # --- adapters -----------------------------------------------------------------------------

    async def _ask(self, inbox: str, make_msg) -> object:
        send, receive = anyio.create_memory_object_stream[object](1)
        async with self._live().sender(inbox) as target:
            await target.send(make_msg(send))
        async with receive:
            answer = await receive.receive()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def _need_lora(self) -> None:
        if not self.args.enable_lora:
            raise LoRADisabledError("adapters need an engine built with enable_lora=True")

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register and load an adapter now (validated and fingerprinted); raises its typed error if it is bad."""
        self._need_lora()
        answer: AdapterResolved = await self._ask("loader", lambda reply: AddLora(lora_request=lora_request, reply=reply))
        if answer.error is not None:
            raise answer.error
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        self._need_lora()
        return bool(await self._ask("loader", lambda reply: RemoveLora(lora_int_id=lora_int_id, reply=reply)))

    async def pin_lora(self, lora_int_id: int) -> bool:
        """Keep an adapter in host memory and in a device slot until it is removed."""
        self._need_lora()
        lora: LoRARequest = await self._ask("loader", lambda reply: PinLora(lora_int_id=lora_int_id, reply=reply))
        answer: AdapterResolved = await self._ask("loader", lambda reply: ResolveAdapter(lora_request=lora, reply=reply))
        if answer.error is not None:
            raise answer.error
        ckpt = answer.checkpoint
        return bool(await self._ask("scheduler", lambda reply: PinSlot(fingerprint=ckpt.fingerprint, checkpoint=ckpt, reply=reply)))

    async def list_loras(self) -> set[int]:
        if not self.args.enable_lora:
            return set()
        return set(await self._ask("loader", lambda reply: ListLoras(reply=reply)))

    async def get_stats(self):
        """The Scheduler's per-step timing summary (StatsSnapshot)."""
        return await self._ask("scheduler", lambda reply: GetStats(reply=reply))


def _close_store(store) -> None:
    if store is not None:
        store.close()
