"""LLMEngine: vLLM's synchronous add_request / step loop, driving the same actors through an anyio portal."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import ExitStack
from typing import Any

import anyio
from anyio.from_thread import start_blocking_portal
from anyio.streams.memory import MemoryObjectReceiveStream

from loraledger.async_engine import AsyncEngine
from loraledger.audit_ids import new_audit_id
from loraledger.engine_args import EngineArgs
from loraledger.engine_client import EngineClient
from loraledger.errors import DuplicateRequestError
from loraledger.lora.request import LoRARequest
from loraledger.outputs import CompletionOutput, RequestOutput
from loraledger.sampling_params import SamplingParams


class LLMEngine:
    """The engine's actors run on an event loop in a background thread; these methods block until it answers."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self._stack = ExitStack()
        self._portal = self._stack.enter_context(start_blocking_portal())
        try:
            self.engine: EngineClient = self._stack.enter_context(
                self._portal.wrap_async_context_manager(AsyncEngine(args))
            )
        except BaseException:
            self._stack.close()
            raise
        self._merged_send, self._merged = anyio.create_memory_object_stream[tuple[str, object]](1 << 16)
        # caller id -> audit key of each unfinished request; an aborted one leaves at once (vLLM), and what its
        # audit key still delivers is dropped
        self._unfinished: dict[str, str] = {}
        self._aborted: set[str] = set()  # audit keys
        self.errors: dict[str, BaseException] = {}  # request id -> why it failed after admission
        self._loras: dict[str, LoRARequest | None] = {}  # audit key -> its adapter
        self._lock = threading.Lock()
        self._closed = False
        # threading's atexit hooks run before Python joins non-daemon threads and finalizes: a script that
        # never calls close() is closed there, while the interpreter is whole (whether the portal's
        # event-loop thread is a daemon has changed between anyio versions; it is one in anyio 4.16.0)
        threading._register_atexit(_close_at_exit, weakref.ref(self))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    # --- the bridge to the engine's event loop (LLM and AsyncLLMEngine cross it) ----------------

    @property
    def closed(self) -> bool:
        """True once close() has begun: the engine takes no more calls."""
        return self._closed

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` (a coroutine function or a plain one) on the engine's event loop; block for its result."""
        return self._portal.call(fn, *args)

    def start_task(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Start `fn(*args)` (a coroutine function) on the engine's event loop; its concurrent Future. RuntimeError
        when that loop has stopped."""
        return self._portal.start_task_soon(fn, *args)

    # --- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: object,
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
        *,
        tenant: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Admit a request (its binding is on record when this returns) and return its request_id, as vLLM's
        add_request does; or raise the typed reason it was refused. request_id may be one a finished or aborted
        request used (DuplicateRequestError only while another unfinished request holds it). The audit log keys the
        request with an id the engine makes (its outputs' audit_id). Without params, the model's defaults
        (generation_config.json) apply."""
        params = params if params is not None else self.engine.get_default_sampling_params()
        with self._lock:  # the id itself is checked by the engine (AsyncEngine.submit), like every other argument
            if isinstance(request_id, str) and request_id in self._unfinished:
                raise DuplicateRequestError(
                    f"request id {request_id!r} is already in use by an unfinished request; use a new id, or reuse this "
                    "one once that request has finished or been aborted"
                )
        audit_id = new_audit_id()
        channel = self._portal.call(
            lambda: self.engine.submit(
                request_id, prompt, params, lora_request, tenant=tenant, arrival_time=arrival_time, audit_id=audit_id
            )
        )
        with self._lock:
            self._unfinished[request_id] = audit_id
            self._loras[audit_id] = lora_request
        self._portal.start_task_soon(self._forward, request_id, audit_id, channel)
        return request_id

    async def _forward(self, request_id: str, audit_id: str, channel: MemoryObjectReceiveStream) -> None:
        async with channel:
            async for delivery in channel:
                await self._merged_send.send((request_id, audit_id, delivery.item))
                if isinstance(delivery.item, BaseException) or delivery.item.finished:
                    return

    def step(self) -> list[RequestOutput]:
        """Wait for the engine's next outputs and return every one that is ready (empty when nothing is unfinished)."""
        with self._lock:
            if not self._unfinished:
                return []
        items = self._portal.call(self._collect)
        outputs = []
        for request_id, audit_id, item in items:
            ended = isinstance(item, BaseException) or item.finished
            with self._lock:
                if audit_id in self._aborted:  # vLLM's LLMEngine emits nothing for a request once it is aborted
                    if ended:
                        self._aborted.discard(audit_id)
                        self._loras.pop(audit_id, None)
                    continue
                if ended:
                    if self._unfinished.get(request_id) == audit_id:
                        del self._unfinished[request_id]
                    lora = self._loras.pop(audit_id, None)
            if isinstance(item, BaseException):
                self.errors[request_id] = item
                item = _error_output(request_id, audit_id, item, lora)
            outputs.append(item)
        return outputs

    async def _collect(self) -> list[tuple[str, str, object]]:
        items = [await self._merged.receive()]
        while True:
            try:
                items.append(self._merged.receive_nowait())
            except anyio.WouldBlock:
                return items

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._unfinished)

    def get_num_unfinished_requests(self) -> int:
        with self._lock:
            return len(self._unfinished)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Abort requests by id, as vLLM's LLMEngine does: they leave get_num_unfinished_requests() and
        has_unfinished_requests() at once, step() returns nothing more of them, and their ids may be used again
        at once. The audit log records each as aborted, with what it had generated. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        if not isinstance(ids, (list, tuple, set, frozenset)) or not all(isinstance(rid, str) for rid in ids):
            self._portal.call(self.engine.abort, request_id)  # raises the engine's typed error for a bad argument
            return
        with self._lock:
            keys = [self._unfinished.pop(rid) for rid in ids if rid in self._unfinished]
            self._aborted.update(keys)
        self._portal.call(self.engine.abort_audit_ids, keys)

    # --- adapters -----------------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self._portal.call(self.engine.add_lora, lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._portal.call(self.engine.remove_lora, lora_int_id)

    def pin_lora(self, lora_int_id: int) -> bool:
        return self._portal.call(self.engine.pin_lora, lora_int_id)

    def list_loras(self) -> set[int]:
        return self._portal.call(self.engine.list_loras)

    def get_stats(self):
        return self._portal.call(self.engine.get_stats)

    def get_tokenizer(self, lora_request: LoRARequest | None = None):
        """The tokenizer requests on `lora_request` use (an adapter's own, if it ships one); None with skip_tokenizer_init."""
        if lora_request is None:
            return self.engine.get_tokenizer(None)
        return self._portal.call(self.engine.get_lora_tokenizer, lora_request)  # a Hub adapter is fetched first

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.get_default_sampling_params()

    # --- shutdown -----------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stack.close()
        # the event loop is gone: nothing sends or receives on the merged stream any more
        self._merged_send.close()
        self._merged.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _error_output(request_id: str, audit_id: str, error: BaseException, lora: LoRARequest | None) -> RequestOutput:
    """A request that failed after admission ends with finish_reason "error" (as in vLLM v1); the exception is in LLMEngine.errors."""
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=None,
        prompt_logprobs=None,
        outputs=[
            CompletionOutput(
                index=0,
                text="",
                token_ids=[],
                cumulative_logprob=None,
                logprobs=None,
                finish_reason="error",
                stop_reason=str(error),
                lora_request=lora,
            )
        ],
        finished=True,
        lora_request=lora,
        audit_id=audit_id,
    )


def _close_at_exit(ref: weakref.ref[LLMEngine]) -> None:
    engine = ref()
    if engine is not None:
        engine.close()
