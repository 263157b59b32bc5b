"""EngineClient: the engine as its callers see it (the server, recovery, the sync facades, the benchmarks).

AsyncEngine implements it. Code outside the engine holds an EngineClient and uses only these members, never the
engine's private state, so the engine's insides may change freely behind it (as vLLM's EngineClient protocol).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectReceiveStream

    from loraledger.engine_args import EngineArgs
    from loraledger.engine_metrics import EngineMetrics
    from loraledger.lora.request import LoRARequest
    from loraledger.outputs import RequestOutput
    from loraledger.sampling_params import SamplingParams
    from loraledger.store.audit_store import AuditStore


@runtime_checkable
class EngineClient(Protocol):
    """A running engine: its state, its model, its requests, its adapters and its audit log."""

    args: EngineArgs

    # --- state ----------------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        """True while the engine serves: started, not stopped, no fatal error."""
        ...

    @property
    def errored(self) -> bool:
        """True once a fatal error (device lost, store corrupt, lease lost) has stopped the engine."""
        ...

    @property
    def dead_error(self) -> BaseException:
        """The EngineDeadError a caller of a stopped engine gets, naming (and chaining) the fatal error, if any."""
        ...

    @property
    def store(self) -> AuditStore | None:
        """The audit store the engine writes (None with auditing off); EngineDeadError when it is not running."""
        ...

    # --- the model ------------------------------------------------------------------------------

    @property
    def model_config(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def base_model_fingerprint(self) -> str: ...

    def get_tokenizer(self, lora_request: LoRARequest | None = None) -> Any: ...

    async def get_lora_tokenizer(self, lora_request: LoRARequest | None = None) -> Any: ...

    def get_default_sampling_params(self) -> SamplingParams: ...

    # --- requests -------------------------------------------------------------------------------

    def new_request_id(self) -> str: ...

    def generate(
        self,
        prompt: object,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        *,
        tenant: str | None = None,
        **caller: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; leaving early aborts it."""
        ...

    async def generate_many(
        self,
        requests: list[tuple[str, object, SamplingParams, LoRARequest | None, str | None]],
        *,
        on_finished: Callable[[RequestOutput], object] | None = None,
        chat_template_sha256: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Admit every request, then wait for all their final outputs (in the given order)."""
        ...

    async def submit(
        self,
        request_id: str,
        prompt: object,
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        **kw: Any,
    ) -> MemoryObjectReceiveStream:
        """Admit one request; its output channel (Delivery items) once it is accepted."""
        ...

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests by the caller's ids."""
        ...

    async def abort_audit_ids(self, audit_ids: list[str]) -> None:
        """Abort requests by their audit keys."""
        ...

    # --- adapters, statistics, the audit log ---------------------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> bool: ...

    async def remove_lora(self, lora_int_id: int) -> bool: ...

    async def pin_lora(self, lora_int_id: int) -> bool: ...

    async def list_loras(self) -> set[int]: ...

    async def get_stats(self) -> Any: ...

    async def get_metrics(self) -> EngineMetrics: ...

    async def record_access_denied(
        self, *, tenant: str | None, key_id: str | None, adapter: str, route: str, caller_request_id: str | None = None
    ) -> bool:
        """Put an access_denied event on record (True once it is committed)."""
        ...
