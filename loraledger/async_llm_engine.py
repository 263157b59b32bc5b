"""AsyncLLMEngine: vLLM's async engine by its name — `from_engine_args(args)` serves at once, `shutdown()` stops it.

`AsyncEngine` runs its actors in the caller's task group, so it is used inside `async with`. vLLM
code builds its engine with a plain call and keeps it (`engine = AsyncLLMEngine.from_engine_args(
AsyncEngineArgs(...))`, often at import time), then awaits `engine.generate(...)` from its own
asyncio loop. This class gives it that shape: the same actors run on an event loop of their own in
a background thread (as LLMEngine's do), and each call and each streamed output crosses into the
caller's asyncio loop. `async with` works too (it shuts the engine down on exit).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import anyio

from loraledger.engine_args import EngineArgs, check_argument_names
from loraledger.engine_client import EngineClient
from loraledger.errors import ConfigError, EngineDeadError
from loraledger.llm_engine import LLMEngine
from loraledger.lora.request import LoRARequest
from loraledger.outputs import RequestOutput
from loraledger.sampling_params import SamplingParams

# vLLM's from_engine_args keywords that select things this engine does not have; accepted with their defaults
_VLLM_KEYWORDS = {"start_engine_loop": True, "usage_context": None, "stat_loggers": None}


class AsyncLLMEngine:
    """vLLM's AsyncLLMEngine (its V1 AsyncLLM): usable as soon as from_engine_args returns; call shutdown() when done."""

    def __init__(self, args: EngineArgs) -> None:
        self._thread = LLMEngine(args)  # the actors, on their own event loop in a background thread
        self.engine: EngineClient = self._thread.engine  # the AsyncEngine on that loop
        self.args = args

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs) -> AsyncLLMEngine:
        """Build and start the engine (loads the model: blocks until it can serve). vLLM's start_engine_loop,
        usage_context and stat_loggers are accepted with their default meaning."""
        check_argument_names(kwargs, _VLLM_KEYWORDS, "AsyncLLMEngine.from_engine_args")
        if kwargs.get("start_engine_loop", True) is not True:
            raise ConfigError("start_engine_loop=False is not supported: the engine serves from the moment it is built")
        if kwargs.get("stat_loggers") is not None:
            raise ConfigError("stat_loggers are not supported; the engine's statistics come from get_stats()")
        if not isinstance(engine_args, EngineArgs):
            raise ConfigError(
                f"engine_args must be an EngineArgs (or AsyncEngineArgs), got {type(engine_args).__name__}"
            )
        return cls(engine_args)

    # --- life cycle ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the engine (outputs still being recorded are flushed first); later calls raise EngineDeadError."""
        self._thread.close()

    @property
    def is_running(self) -> bool:
        return not self._thread.closed and self.engine.is_running

    @property
    def errored(self) -> bool:
        return self.engine.errored

    @property
    def dead_error(self) -> BaseException:
        return self.engine.dead_error

    @property
    def store(self):
        """The audit store the engine writes (None with auditing off)."""
        return self.engine.store

    async def check_health(self) -> None:
        if not self.is_running:
            raise self.dead_error

    async def __aenter__(self) -> AsyncLLMEngine:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await anyio.to_thread.run_sync(self.shutdown)

    # --- requests -----------------------------------------------------------------------------

    async def generate(
        self,
        prompt: object,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        *,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (per its output_kind) into the caller's asyncio loop; stopping early aborts
        it. A refused request raises its own typed error."""
        loop = _asyncio_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        async def pump() -> None:  # on the engine's loop
            try:
                async for out in self.engine.generate(prompt, sampling_params, request_id, lora_request, tenant=tenant):
                    put(out)
            except anyio.get_cancelled_exc_class():
                raise  # the caller stopped listening; AsyncEngine.generate aborted the request
            except BaseException as exc:
                put(_Failed(exc))
            else:
                put(_END)

        future = self._start(pump)
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:
            if not future.done():
                future.cancel()

    async def abort(self, request_id: str | list[str]) -> None:
        await self._call(self.engine.abort, request_id)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return await self._call(self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self._call(self.engine.remove_lora, lora_int_id)

    async def pin_lora(self, lora_int_id: int) -> bool:
        return await self._call(self.engine.pin_lora, lora_int_id)

    async def list_loras(self) -> set[int]:
        return await self._call(self.engine.list_loras)

    async def get_stats(self):
        return await self._call(self.engine.get_stats)

    async def get_tokenizer(self, lora_request: LoRARequest | None = None):
        return await self.engine.get_lora_tokenizer(lora_request)

    async def get_model_config(self):
        return self.engine.model_config

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.get_default_sampling_params()

    # --- the bridge between the caller's loop and the engine's ----------------------------------

    def _start(self, fn, *args, **kwargs):
        """Run `fn(*args, **kwargs)` on the engine's loop; its concurrent Future."""
        if self._thread.closed:
            raise EngineDeadError("the engine was shut down; build a new one with AsyncLLMEngine.from_engine_args(...)")
        try:
            return self._thread.start_task(functools.partial(fn, *args, **kwargs))
        except RuntimeError as exc:  # the portal's loop has stopped
            raise EngineDeadError(
                "the engine has stopped; build a new one with AsyncLLMEngine.from_engine_args(...)"
            ) from exc

    async def _call(self, fn, *args, **kwargs):
        _asyncio_loop()
        return await asyncio.wrap_future(self._start(fn, *args, **kwargs))


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


def _asyncio_loop() -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise ConfigError(
            "AsyncLLMEngine serves asyncio callers, and no asyncio loop runs here; under trio (or any anyio backend) use "
            "`async with AsyncEngine.from_engine_args(args) as engine:`"
        ) from None
