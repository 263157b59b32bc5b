"""LLMEngine: vLLM's synchronous add_request / step loop, driving the same actors through an anyio portal."""

from __future__ import annotations

import threading
import weakref
from contextlib import ExitStack

import anyio
from anyio.from_thread import start_blocking_portal
from anyio.streams.memory import MemoryObjectReceiveStream

from loraledger.async_engine import AsyncEngine
from loraledger.engine_args import EngineArgs
from loraledger.errors import DuplicateRequestError
from loraledger.lora_request import LoRARequest
from loraledger.outputs import CompletionOutput, RequestOutput
from loraledger.sampling_params import SamplingParams


class LLMEngine:
    """The engine's actors run on an event loop in a background thread; these methods block until it answers."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self._stack = ExitStack()
        self._portal = self._stack.enter_context(start_blocking_portal())
        try:
            self.engine: AsyncEngine = self._stack.enter_context(self._portal.wrap_async_context_manager(AsyncEngine(args)))
        except BaseException:
            self._stack.close()
            raise
        self._merged_send, self._merged = anyio.create_memory_object_stream[tuple[str, object]](1 << 16)
        self._unfinished: set[str] = set()
        self.errors: dict[str, BaseException] = {}  # request id -> why it failed after admission
        self._loras: dict[str, LoRARequest | None] = {}
        self._lock = threading.Lock()
        self._closed = False
        # threading's atexit hooks run before Python joins non-daemon threads and finalizes: a script that
        # never calls close() is closed there, while the interpreter is whole (whether the portal's
        # event-loop thread is a daemon has changed between anyio versions; it is one in anyio 4.16.0)
        threading._register_atexit(_close_at_exit, weakref.ref(self))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

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
    ) -> None:
        """Admit a request (its binding is on record when this returns) or raise the typed reason it was refused.
        Without params, the model's defaults (generation_config.json) apply."""
        params = params if params is not None else self.engine.get_default_sampling_params()
        with self._lock:  # the id itself is checked by the engine (AsyncEngine.submit), like every other argument
            if isinstance(request_id, str) and request_id in self._unfinished:
                raise DuplicateRequestError(f"request id {request_id!r} is already in flight; use a new id")
        channel = self._portal.call(lambda: self.engine.submit(request_id, prompt, params, lora_request, tenant=tenant, arrival_time=arrival_time))
        with self._lock:
            self._unfinished.add(request_id)
            self._loras[request_id] = lora_request
        self._portal.start_task_soon(self._forward, request_id, channel)

    async def _forward(self, request_id: str, channel: MemoryObjectReceiveStream) -> None:
        async with channel:
            async for delivery in channel:
                await self._merged_send.send((request_id, delivery.item))
                if isinstance(delivery.item, BaseException) or delivery.item.finished:
                    return

    def step(self) -> list[RequestOutput]:
        """Wait for the engine's next outputs and return every one that is ready (empty when nothing is unfinished)."""
        with self._lock:
            if not self._unfinished:
                return []
        items = self._portal.call(self._collect)
        outputs = []
        for request_id, item in items:
            if isinstance(item, BaseException):
                self.errors[request_id] = item
                item = _error_output(request_id, item, self._loras.get(request_id))
            if item.finished:
                with self._lock:
                    self._unfinished.discard(request_id)
                    self._loras.pop(request_id, None)
            outputs.append(item)
        return outputs

    async def _collect(self) -> list[tuple[str, object]]:
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
        """Abort; the request's final output (finish_reason "abort") still comes out of step()."""
        self._portal.call(self.engine.abort, request_id)

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
        return self.engine.get_tokenizer(lora_request)

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.get_default_sampling_params()

    # --- shutdown -----------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stack.close()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _error_output(request_id: str, error: BaseException, lora: LoRARequest | None) -> RequestOutput:
    """A request that failed after admission ends with finish_reason "error" (as in vLLM v1); the exception is in LLMEngine.errors."""
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=None,
        prompt_logprobs=None,
        outputs=[CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None, finish_reason="error", stop_reason=str(error), lora_request=lora)],
        finished=True,
        lora_request=lora,
    )



def _close_at_exit(ref: "weakref.ref[LLMEngine]") -> None:
    engine = ref()
    if engine is not None:
        engine.close()
