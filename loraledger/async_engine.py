"""AsyncEngine: the asyncio/trio-friendly engine (`async with AsyncEngine.from_engine_args(args) as engine`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from loraledger.actors.engine_core import EngineCore
from loraledger.actors.messages import (
    Abort,
    Accepted,
    AdapterResolved,
    AddLora,
    AuditAppend,
    Delivery,
    GetStats,
    ListLoras,
    PinLora,
    RemoveLora,
    ResolveAdapter,
)
from loraledger.audit_ids import new_audit_id
from loraledger.engine_args import EngineArgs
from loraledger.engine_audit import access_denied_event, append_and_wait
from loraledger.engine_metrics import EngineMetrics, engine_metrics
from loraledger.errors import (
    AuditUnavailableError,
    EngineDeadError,
    LoRADisabledError,
)
from loraledger.generate_many import generate_many
from loraledger.input_processor import (
    EdgeLimits,
    check_abort_ids,
    check_arguments,
    check_audit_ids,
    check_lora_int_id,
    check_lora_request,
)
from loraledger.lora.request import LoRARequest
from loraledger.outputs import RequestOutput
from loraledger.recovery import Recovery
from loraledger.sampling_params import SamplingParams
from loraledger.sources.engine_sources import tokenizer_lora


class AsyncEngine:
    """One engine: the actors run in this event loop's task group for as long as the `async with` lasts."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self._core: EngineCore | None = None
        self._stack: AsyncExitStack | None = None
        self._tg = None
        self._admission: MemoryObjectSendStream | None = None
        self._limits: EdgeLimits | None = None  # what check_arguments checks requests against, once started
        self._recovery = Recovery(self)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncEngine:
        return cls(args)

    # --- life cycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncEngine:
        from loraledger.engine_setup import StartDeadline, prepare_within

        deadline = StartDeadline(self.args)
        setup = await prepare_within(deadline, self.args)
        self._stack = AsyncExitStack()
        try:
            self._tg = await self._stack.enter_async_context(anyio.create_task_group())
            self._core = EngineCore(setup)
            with deadline.step("loading the weights and starting the actors"):
                await self._core.start(self._tg)
        except BaseException:
            if self._tg is not None:  # the actors already started stop too (a start past its deadline raised here)
                self._tg.cancel_scope.cancel()
            await self._stack.aclose()
            _close_store(setup.store)
            raise
        self._admission = self._core.sender("admission")
        self._limits = EdgeLimits(
            max_model_len=setup.max_model_len,
            vocab_size=setup.model_config.vocab_size,
            max_n=setup.max_n,
            max_logprobs=self.args.max_logprobs,
            has_tokenizer=setup.tokenizer is not None,
            enable_lora=self.args.enable_lora,
        )
        if setup.store is not None:
            try:
                await self._recovery.start(self._tg)
            except BaseException:
                await self.__aexit__(None, None, None)
                raise
        return self

    @property
    def interrupted(self) -> list[str]:
        """Audit keys of the requests this engine recorded as interrupted: at start, or a peer's whose lease expired."""
        return self._recovery.interrupted

    @property
    def resumed(self) -> dict[str, object]:
        """With resume_interrupted: audit key -> final RequestOutput or error of each resumed request."""
        return self._recovery.resumed

    async def wait_resumed(self) -> dict[str, object]:
        """Wait until every resumed request (so far) has its outcome (final RequestOutput or error) in `resumed`."""
        return await self._recovery.wait()

    async def __aexit__(self, *exc_info) -> None:
        """Stop the engine. An exception from the `async with` body goes on as itself: it is not handed to the
        actors' task group, which would wrap it in an ExceptionGroup (`except DuplicateRequestError` must work)."""
        core, stack = self._core, self._stack
        if core is None or stack is None:
            return None
        try:
            if self._admission is not None:
                self._admission.close()
            await core.stop()
        finally:
            self._core = None
            # whatever is left (a resume of interrupted requests, an actor past the stop deadline) is cancelled;
            # the actors have returned, so the task group ends without an error of its own
            self._tg.cancel_scope.cancel()
            try:
                await stack.aclose()
            finally:
                _close_store(core.setup.store)
        return None

    # --- the EngineClient seam: what code outside the engine may know of its state ---------------

    @property
    def is_running(self) -> bool:
        """True while the engine serves: inside its `async with`, no fatal error."""
        return self._core is not None and self._core.fatal is None

    @property
    def errored(self) -> bool:
        """True once a fatal error (device lost, store corrupt, lease lost) has stopped the engine."""
        return self._core is not None and self._core.fatal is not None

    @property
    def dead_error(self) -> EngineDeadError:
        """The EngineDeadError a caller of the stopped engine gets, naming (and chaining) the fatal error, if any."""
        return self._dead_error("the engine has stopped")

    @property
    def store(self):
        """The audit store this engine writes (an AuditStore; None with auditing off)."""
        return self._live().setup.store

    @property
    def instance_id(self) -> str | None:
        """This engine's instance id in its audit database (on every requests row and event it writes); None with auditing off."""
        return None if (store := self.store) is None else store.instance_id

    @property
    def tokenizer(self):
        """The model's tokenizer (None with skip_tokenizer_init)."""
        return self._live().setup.tokenizer

    def get_tokenizer(self, lora_request: LoRARequest | None = None):
        """The tokenizer a request on `lora_request` uses: the adapter's own when its folder ships one, else the
        model's (vLLM's get_tokenizer(lora_request)); None with skip_tokenizer_init. May read the adapter folder."""
        core = self._live()
        if lora_request is not None:
            lora_request = self._check_lora(lora_request)
        return core.setup.tokenizers.get(lora_request if self.args.enable_lora else None)

    async def get_lora_tokenizer(self, lora_request: LoRARequest | None = None):
        """get_tokenizer for any adapter, a Hub one too: the adapter is resolved first (fetched, or the commit it was
        loaded at), so the tokenizer files or chat template it ships are read from the folder its weights come from.
        Reads run off the event loop; a load that fails raises the adapter's typed error."""
        core = self._live()
        if lora_request is not None:
            lora_request = self._check_lora(lora_request)
        if lora_request is None or not self.args.enable_lora or core.setup.tokenizers.base is None:
            return core.setup.tokenizers.get(None)  # no adapter, or no tokenizer at all (skip_tokenizer_init)
        answer: AdapterResolved = await self._ask(
            "loader", lambda reply: ResolveAdapter(lora_request=lora_request, reply=reply)
        )
        if answer.error is not None:
            raise answer.error
        lora = tokenizer_lora(lora_request, answer.checkpoint)
        if core.setup.tokenizers.cached(lora):
            return core.setup.tokenizers.get(lora)
        return await anyio.to_thread.run_sync(core.setup.tokenizers.get, lora)

    def get_default_sampling_params(self) -> SamplingParams:
        """A new SamplingParams of the model's generation_config.json defaults (generation_config="auto"; vLLM's
        LLM.get_default_sampling_params); plain SamplingParams() when the file sets none or is ignored."""
        from loraledger.generation_config import defaults_params

        generation = self._live().setup.generation
        return defaults_params(generation) if generation is not None else SamplingParams()

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
            raise EngineDeadError(
                "the engine is not running; use it inside `async with AsyncEngine.from_engine_args(args) as engine:`"
            )
        return self._core

    def _dead_error(self, message: str, cause: BaseException | None = None) -> EngineDeadError:
        """EngineDeadError for `message`, naming (and chaining) the failure that stopped the engine, if one did."""
        fatal = self._core.fatal if self._core is not None else None
        if fatal is None:
            error = EngineDeadError(message)
            error.__cause__ = cause
            return error
        error = EngineDeadError(
            f"{message}: the engine stopped after a fatal error ({type(fatal).__name__}: {fatal}); start a new engine"
        )
        error.__cause__ = fatal
        return error

    # --- requests -----------------------------------------------------------------------------

    def new_request_id(self) -> str:
        """A request id no other request uses: a new audit key (loraledger.audit_ids), used as the caller's id when
        the caller gives none."""
        return new_audit_id()

    def _channel_size(self, params: SamplingParams) -> int:
        # a request delivers at most one item per generated token, plus acceptance and the final
        room = self.max_model_len
        return min(params.max_tokens or room, room) + 8

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
        chat_template_sha256: str | None = None,
        key_id: str | None = None,
        user: str | None = None,
        audit_id: str | None = None,
        bound_commit: str | None = None,
        tool_calls: object = None,
        resume_note: str | None = None,
    ) -> MemoryObjectReceiveStream:
        """Admit one request; returns its output channel once the request is accepted, or raises why not.

        request_id is the caller's id (vLLM's: any non-empty str; DuplicateRequestError while another live request
        holds it, reusable once that one has finished or been aborted). The audit log keys the request with
        audit_id, a new UUIDv7 (loraledger.audit_ids) unless given: the caller passes its own only to know the key
        before the first output (generate and LLMEngine do, to abort precisely) or, with resume, the key on record.

        The API edge of every entry point (LLM.generate, LLMEngine.add_request, generate): the input processor's
        check_arguments checks each argument's type and value here and makes the engine's own immutable copy, so a
        value the caller changes afterwards changes nothing; what only the model can tell (token ids in its
        vocabulary, the prompt's length in tokens, the adapter) is its check_model_inputs' at admission.
        chat_template_sha256: set by LLM.chat and the chat route, the digest of the template that rendered the prompt
        (the binding's chat_template_sha256). bound_commit: with resume, the Hub commit the binding's adapter was read
        at; the adapter is read at that commit again, wherever its branch is now.
        key_id, user: set by the HTTP server (loraledger serve): the id of the API key that authenticated the caller (the
        binding's key_id; the same key gave `tenant`) and OpenAI's `user` field (in the request_admitted event's payload).
        tool_calls: the server's loraledger.tool_calls.ToolCallSpec for a request with tools (on record with it);
        resume_note: with resume, why its tool calls cannot be read as before (its request_resumed event says it)."""
        core = self._live()
        if core.fatal is not None:
            raise self._dead_error("the engine has stopped and takes no new requests")
        submit = check_arguments(
            request_id,
            prompt,
            params,
            lora_request,
            limits=self._limits,
            audit_id=audit_id if audit_id is not None else new_audit_id(),
            now=time.time(),
            tenant=tenant,
            arrival_time=arrival_time,
            resume=resume,
            bound_fingerprint=bound_fingerprint,
            chat_template_sha256=chat_template_sha256,
            key_id=key_id,
            user=user,
            tool_calls=tool_calls,
        )
        send, receive = anyio.create_memory_object_stream[Delivery](self._channel_size(submit.params))
        resumed = {"bound_commit": bound_commit, "resume_note": resume_note} if resume else {}
        msg = msgspec.structs.replace(submit, channel=send, **resumed)
        try:
            await self._admission.send(msg)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            send.close()
            receive.close()
            raise self._dead_error("the engine has stopped and takes no new requests", exc) from None
        try:
            first = await receive.receive()
        except anyio.EndOfStream:
            receive.close()
            raise self._dead_error(f"the engine stopped while admitting request {submit.caller_request_id!r}") from None
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
        **caller,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (per its output_kind); stopping early aborts the request. Without
        sampling_params, the model's defaults (get_default_sampling_params) apply; without request_id, the request's
        audit key is its id too. caller: submit's key_id, user and chat_template_sha256."""
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        audit_id = new_audit_id()
        rid = request_id if request_id is not None else audit_id
        channel = await self.submit(rid, prompt, params, lora_request, tenant=tenant, audit_id=audit_id, **caller)
        finished = False
        try:
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
            try:
                if not finished and self._core is not None:
                    with anyio.CancelScope(shield=True):
                        await self.abort_audit_ids(
                            [audit_id]
                        )  # by its key: its caller id may be another request's by now
                        await self._until_ended(channel)
            finally:
                channel.close()

    async def _until_ended(self, channel: MemoryObjectReceiveStream) -> None:
        """After an abort: wait for the request's last item, so what it generated is on record as aborted (its final
        output is released after its commit) when the caller's cleanup ends; at most audit_timeout seconds."""
        with anyio.move_on_after(self.args.audit_timeout + 1):
            async for delivery in channel:
                item = delivery.item
                if isinstance(item, BaseException) or item.finished:
                    return

    async def generate_many(
        self,
        requests: list[tuple[str, object, SamplingParams, LoRARequest | None, str | None]],
        *,
        on_finished=None,
        chat_template_sha256: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Admit every request first (a refused one raises before any output is awaited, and the rest are aborted),
        then wait for all final outputs, returned in the given order. on_finished(output) is called as each
        request finishes (a progress bar); chat_template_sha256: per request, the template that rendered it."""
        return await generate_many(self, requests, on_finished=on_finished, chat_template_sha256=chat_template_sha256)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests by the caller's id; ids that are not in flight are ignored. An aborted request's id is free
        for a new request at once (vLLM); its audit record ends as aborted, with what it generated."""
        ids = check_abort_ids(request_id)
        await self._send_abort(Abort(request_ids=ids))

    async def abort_audit_ids(self, audit_ids: list[str]) -> None:
        """Abort requests by their audit keys (RequestOutput.audit_id); keys not in flight are ignored."""
        await self._send_abort(Abort(request_ids=[], audit_ids=check_audit_ids(audit_ids)))

    async def _send_abort(self, msg: Abort) -> None:
        if self._admission is None:
            return
        try:
            await self._admission.send(msg)
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

    _check_lora = staticmethod(check_lora_request)
    _check_int_id = staticmethod(check_lora_int_id)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register and load an adapter now (validated and fingerprinted); raises its typed error if it is bad."""
        self._need_lora()
        lora_request = self._check_lora(lora_request)
        answer: AdapterResolved = await self._ask(
            "loader", lambda reply: AddLora(lora_request=lora_request, reply=reply)
        )
        if answer.error is not None:
            raise answer.error
        core = self._live()
        if core.setup.store is not None:
            # on record (the adapters row and its adapter_registered event) before add_lora returns; the store
            # writes a fingerprint's row once, so the loader's own record of this load changes nothing
            record = answer.checkpoint.to_record(core.setup.base_model_fingerprint, time.time())
            await self._append_and_wait(AuditAppend(adapters=[record]), f"adapter {lora_request.lora_name!r} is loaded")
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        self._need_lora()
        lora_int_id = self._check_int_id(lora_int_id)
        return bool(await self._ask("loader", lambda reply: RemoveLora(lora_int_id=lora_int_id, reply=reply)))

    async def pin_lora(self, lora_int_id: int) -> bool:
        """Keep an adapter in host memory and in a device slot until it is removed (loaded first if need be)."""
        self._need_lora()
        lora_int_id = self._check_int_id(lora_int_id)
        return bool(await self._ask("loader", lambda reply: PinLora(lora_int_id=lora_int_id, reply=reply)))

    async def list_loras(self) -> set[int]:
        if not self.args.enable_lora:
            return set()
        return set(await self._ask("loader", lambda reply: ListLoras(reply=reply)))

    async def get_stats(self):
        """The Scheduler's per-step timing summary and queue state (StatsSnapshot)."""
        return await self._ask("scheduler", lambda reply: GetStats(reply=reply))

    async def get_metrics(self) -> EngineMetrics:
        """What a server's /metrics shows of the engine: the Scheduler's queues and KV use, adapter loads and
        evictions (host cache and device slots), the audit writer's queue depth and failures."""
        core = self._live()
        return engine_metrics(core, await self.get_stats())

    # --- the audit log ------------------------------------------------------------------------

    async def record_access_denied(
        self, *, tenant: str | None, key_id: str | None, adapter: str, route: str, caller_request_id: str | None = None
    ) -> bool:
        """Put an access_denied event on record (the HTTP server refused a key a model it may not use): tenant, key id,
        the model (adapter) asked for and the route; no request id, no binding. Waits for the commit, at most
        audit_timeout seconds; False when it is not on record by then (the store is down: the writer keeps it and
        retries) or auditing is off."""
        if self.store is None:
            return False
        event = access_denied_event(tenant, key_id, adapter, route, caller_request_id)
        try:
            await self._append_and_wait(
                AuditAppend(events=[event]), "access was denied", timeout=self.args.audit_timeout
            )
        except AuditUnavailableError:
            return False
        return True

    async def _append_and_wait(self, msg: AuditAppend, what: str, *, timeout: float | None = None) -> None:
        """Send records to the audit writer and wait until they are committed (or refused: its error is raised).
        timeout: at most this long (default: twice audit_timeout, and a connect), then AuditUnavailableError."""
        limit = timeout if timeout is not None else 2 * self.args.audit_timeout + 2
        async with self._live().sender("audit") as audit:
            await append_and_wait(audit, msg, what, limit)


def _close_store(store) -> None:
    if store is not None:
        store.close()
