"""AdapterLoader actor: reads PEFT adapters in worker threads, keeps a host LRU of max_cpu_loras, owns the name/id registry."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from loraledger.actors.failures import request_error
from loraledger.actors.messages import (
    AdapterResolved,
    AddLora,
    AuditAppend,
    ListLoras,
    PinLora,
    RemoveLora,
    ResolveAdapter,
    Shutdown,
    UnpinSlot,
)
from loraledger.actors.replies import answer
from loraledger.errors import (
    AdapterError,
    LoraLedgerError,
    LoRARequestConflictError,
    TooManyLoRAsError,
    UnknownRequestError,
)
from loraledger.gpu.config import ModelConfig
from loraledger.gpu.lora_checkpoint import LoraCheckpoint, load_lora_checkpoint
from loraledger.logging import get_logger
from loraledger.lora_request import LoRARequest
from loraledger.sources import HubSettings, resolve
from loraledger.sources.engine_sources import adapter_settings
from loraledger.sources.fileset import ADAPTER
from loraledger.store.records import EventKind, EventRecord

# resumed requests' adapters not registered here take ids down from here: far from the ids callers count up from 1
RESUMED_IDS_BELOW = 1 << 63


class AdapterLoaderStats:
    """Counters the AdapterLoader publishes (it alone writes them, on the event loop), by adapter name."""

    def __init__(self) -> None:
        self.loads: Counter[str] = Counter()  # adapters read from disk into the host cache
        self.evictions: Counter[str] = Counter()  # adapters dropped from the host cache (LRU, max_cpu_loras)
        self.failures: Counter[str] = Counter()  # loads that failed


class AdapterLoader:
    def __init__(
        self,
        inbox: MemoryObjectReceiveStream,
        audit: MemoryObjectSendStream | None,
        scheduler: MemoryObjectSendStream,
        *,
        model_config: ModelConfig,
        max_lora_rank: int,
        max_cpu_loras: int,
        max_loras: int,
        base_model_fingerprint: str,
        hub_settings: Callable[[], HubSettings] | None = None,  # how Hub adapters are fetched (read at each load)
    ) -> None:
        self._inbox = inbox
        self._audit = audit
        self._scheduler = scheduler
        self._model_config = model_config
        self._max_lora_rank = max_lora_rank
        self._capacity = max_cpu_loras
        self._max_loras = max_loras
        self._base_fp = base_model_fingerprint
        self._hub_settings = hub_settings or _default_hub_settings
        self._commits: dict[tuple[int, str], str] = {}  # (lora_int_id, lora_path) -> the Hub commit it was read at
        self._registry: dict[int, LoRARequest] = {}  # lora_int_id -> first LoRARequest seen
        self._names: dict[str, int] = {}
        self._cache: OrderedDict[int, LoraCheckpoint] = OrderedDict()  # host LRU, most recent last
        self._pinned: set[int] = set()
        self._loading: dict[int, list[MemoryObjectSendStream]] = {}
        self.stats = AdapterLoaderStats()
        self._log = get_logger("adapter_loader")

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        async with self._inbox, anyio.create_task_group() as tg:
            task_status.started()
            async for msg in self._inbox:
                if isinstance(msg, Shutdown):
                    break
                try:
                    await self._handle(tg, msg)
                except (
                    Exception
                ) as exc:  # the failure boundary: this message's asker gets the error, the loader goes on
                    self._log.exception("message not handled", kind=type(msg).__name__)
                    await self._answer_error(msg, exc)
            tg.cancel_scope.cancel()

    async def _handle(self, tg, msg) -> None:
        match msg:
            case ResolveAdapter(lora_request=lora, reply=reply, resumed=resumed):
                self._resolve(tg, self._for_resume(lora) if resumed else lora, reply)
            case AddLora(lora_request=lora, reply=reply):
                self._resolve(tg, lora, reply)
            case RemoveLora(lora_int_id=int_id, reply=reply):
                await self._remove(int_id, reply)
            case PinLora(lora_int_id=int_id, reply=reply):
                await self._pin(tg, int_id, reply)
            case ListLoras(reply=reply):
                await answer(reply, sorted(self._registry))

    async def _answer_error(self, msg, exc: Exception) -> None:
        lora = getattr(msg, "lora_request", None)
        error = request_error(exc, getattr(lora, "lora_name", "-"), "adapter loader")
        reply = getattr(msg, "reply", None)
        if isinstance(msg, (ResolveAdapter, AddLora)):
            if getattr(lora, "lora_int_id", None) in self._loading:
                return  # its load is under way, and it answers every waiter
            await answer(reply, AdapterResolved(lora_request=lora, error=error))
        else:
            await answer(reply, error)

    # --- registry -----------------------------------------------------------------------------

    def _register(self, lora: LoRARequest) -> None:
        known = self._registry.get(lora.lora_int_id)
        # the registry keeps the adapter, not a request's one-off ask to read it again (pin_lora resolves what it holds)
        kept = (
            LoRARequest(lora.lora_name, lora.lora_int_id, lora.lora_path, lora.base_model_name)
            if lora.load_inplace
            else lora
        )
        if known is not None and lora.load_inplace and known.lora_name == lora.lora_name:
            self._registry[lora.lora_int_id] = kept  # an in-place reload may read the adapter from a new folder
            return
        if known is not None and known.lora_path != lora.lora_path:
            raise LoRARequestConflictError(
                f"lora_int_id {lora.lora_int_id} is already registered for path {known.lora_path!r} "
                f"(as {known.lora_name!r}); got path {lora.lora_path!r}. Use a new id for a different adapter, "
                "remove_lora() the old one first, or reload it under the same name with load_inplace=True"
            )
        other = self._names.get(lora.lora_name)
        if other is not None and self._registry[other].lora_path != lora.lora_path:
            raise LoRARequestConflictError(
                f"lora_name {lora.lora_name!r} is already registered for path {self._registry[other].lora_path!r}; "
                f"got path {lora.lora_path!r}. Use a new name for a different adapter"
            )
        if known is None:
            self._registry[lora.lora_int_id] = kept
            self._names.setdefault(lora.lora_name, lora.lora_int_id)

    def _for_resume(self, lora: LoRARequest) -> LoRARequest:
        """A resumed request's adapter as this engine registers it. Its binding's lora_int_id is a handle the engine
        that admitted it gave (a peer sharing the audit database, or this engine's previous run): here that id may
        name another adapter, or be the one a caller (the server numbers its adapters from 1) gives another later.
        So: the adapter registered here under the same name and path, else the highest id free here."""
        same = self._names.get(lora.lora_name)
        if same is not None and self._registry[same].lora_path == lora.lora_path:
            return LoRARequest(lora.lora_name, same, lora.lora_path)
        free = RESUMED_IDS_BELOW - 1
        while free in self._registry:
            free -= 1
        return LoRARequest(lora.lora_name, free, lora.lora_path)

    def _resolve(self, tg, lora: LoRARequest, reply: MemoryObjectSendStream) -> None:
        try:
            self._register(lora)
        except LoRARequestConflictError as exc:
            tg.start_soon(answer, reply, AdapterResolved(lora_request=lora, error=exc))
            return
        waiters = self._loading.get(lora.lora_int_id)
        if waiters is not None:  # a load of this adapter is already running (an in-place reload too): share it
            waiters.append(reply)
            return
        if lora.load_inplace:
            # vLLM's in-place reload: read the folder again. Requests admitted before keep the checkpoint they were
            # bound to (its device slot and prefix-cache blocks are keyed by its fingerprint, the new content's by
            # its own), so nothing running changes under them.
            self._cache.pop(lora.lora_int_id, None)
        cached = self._cache.get(lora.lora_int_id)
        if cached is not None:
            self._cache.move_to_end(lora.lora_int_id)
            tg.start_soon(answer, reply, AdapterResolved(lora_request=lora, checkpoint=cached))
            return
        self._loading[lora.lora_int_id] = [reply]
        tg.start_soon(self._load, lora)

    async def _load(self, lora: LoRARequest) -> None:
        """Load one adapter in a worker thread and answer everyone waiting for it; whatever fails is their error."""
        try:
            ckpt = await self._read(lora)
            await self._loaded(lora, ckpt)
        except Exception as exc:  # every load failure is the askers' error, never the engine's
            await self._failed(lora, exc)

    async def _read(self, lora: LoRARequest) -> LoraCheckpoint:
        started = time.perf_counter()
        try:
            # read again after an eviction: the commit first resolved, unless the caller asked to reload it in place
            earlier = None if lora.load_inplace else self._commits.get((lora.lora_int_id, lora.lora_path))
            ckpt = await _in_worker(lambda: self._read_source(lora, earlier))
        except LoraLedgerError:
            raise
        except Exception as exc:  # an error load_lora_checkpoint does not type yet: still the adapter's problem
            error = AdapterError(
                f"the adapter could not be loaded ({type(exc).__name__}: {exc}); check the folder's files",
                lora_name=lora.lora_name,
                lora_path=lora.lora_path,
            )
            raise error from exc
        self._log.info(
            "adapter loaded",
            adapter=lora.lora_name,
            fingerprint=ckpt.fingerprint[:12],
            rank=ckpt.rank,
            seconds=round(time.perf_counter() - started, 4),
        )
        return ckpt

    def _read_source(self, lora: LoRARequest, earlier: str | None) -> LoraCheckpoint:
        """In a worker: lora_path resolved (a Hub repo id fetched, under its deadline and size limit), then read."""
        source = resolve(lora.lora_path, kind=ADAPTER, settings=self._hub_settings(), at_commit=earlier)
        ckpt = load_lora_checkpoint(
            source.folder,
            lora_name=lora.lora_name,
            lora_int_id=lora.lora_int_id,
            model_config=self._model_config,
            max_lora_rank=self._max_lora_rank,
        )
        return dataclasses.replace(ckpt, path=lora.lora_path, source=source)

    async def _loaded(self, lora: LoRARequest, ckpt: LoraCheckpoint) -> None:
        self._cache[lora.lora_int_id] = ckpt
        if ckpt.source is not None and ckpt.source.commit is not None:
            self._commits[(lora.lora_int_id, lora.lora_path)] = ckpt.source.commit
        self.stats.loads[lora.lora_name] += 1
        await self._evict_over_capacity()
        if self._audit is not None:
            await self._audit.send(
                AuditAppend(
                    adapters=[ckpt.to_record(self._base_fp, time.time())],
                    events=[
                        EventRecord(
                            kind=EventKind.ADAPTER_LOADED,
                            at=time.time(),
                            payload={
                                "fingerprint": ckpt.fingerprint,
                                "name": ckpt.name,
                                "int_id": ckpt.int_id,
                                "path": ckpt.path,
                            },
                        )
                    ],
                )
            )
        for reply in self._loading.pop(lora.lora_int_id, []):
            await answer(reply, AdapterResolved(lora_request=lora, checkpoint=ckpt))

    async def _failed(self, lora: LoRARequest, exc: Exception) -> None:
        self._log.warning("adapter load failed", adapter=lora.lora_name, lora_int_id=lora.lora_int_id, error=str(exc))
        error = request_error(exc, lora.lora_name, "adapter loader")
        # a failed adapter is forgotten so a corrected folder can be registered again
        self._cache.pop(lora.lora_int_id, None)
        if self._registry.get(lora.lora_int_id) == lora:
            del self._registry[lora.lora_int_id]
            if self._names.get(lora.lora_name) == lora.lora_int_id:
                del self._names[lora.lora_name]
        waiters = self._loading.pop(lora.lora_int_id, [])
        self.stats.failures[lora.lora_name] += 1
        try:
            await self._record(
                EventRecord(
                    kind=EventKind.ADAPTER_FAILED,
                    at=time.time(),
                    payload={
                        "name": lora.lora_name,
                        "int_id": lora.lora_int_id,
                        "path": lora.lora_path,
                        "error": f"{type(error).__name__}: {error}",
                    },
                )
            )
        finally:
            for reply in waiters:
                await answer(reply, AdapterResolved(lora_request=lora, error=error))

    async def _evict_over_capacity(self) -> None:
        while len(self._cache) > self._capacity:
            victim = next((i for i in self._cache if i not in self._pinned), None)
            if victim is None:
                return
            ckpt = self._cache.pop(victim)
            self.stats.evictions[ckpt.name] += 1
            self._log.info("adapter evicted from host cache", adapter=ckpt.name, fingerprint=ckpt.fingerprint[:12])
            await self._record(
                EventRecord(
                    kind=EventKind.ADAPTER_EVICTED,
                    at=time.time(),
                    payload={"fingerprint": ckpt.fingerprint, "name": ckpt.name, "where": "host"},
                )
            )

    async def _record(self, event: EventRecord) -> None:
        if self._audit is not None:
            await self._audit.send(AuditAppend(events=[event]))

    async def _remove(self, int_id: int, reply) -> None:
        lora = self._registry.pop(int_id, None)
        if lora is None:
            await answer(reply, False)
            return
        if self._names.get(lora.lora_name) == int_id:
            del self._names[lora.lora_name]
        self._pinned.discard(int_id)
        self._commits.pop((int_id, lora.lora_path), None)
        ckpt = self._cache.pop(int_id, None)
        if ckpt is not None:
            try:
                await self._scheduler.send(UnpinSlot(fingerprint=ckpt.fingerprint))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
        await answer(reply, True)

    async def _pin(self, tg, int_id: int, reply) -> None:
        if int_id not in self._registry:
            await answer(
                reply, UnknownRequestError(f"no adapter with lora_int_id {int_id} is registered; add_lora() it first")
            )
            return
        if int_id not in self._pinned and len(self._pinned) >= self._max_loras:
            await answer(reply, TooManyLoRAsError(f"cannot pin more than max_loras={self._max_loras} adapters"))
            return
        self._pinned.add(int_id)
        await answer(reply, self._registry[int_id])


def _default_hub_settings() -> HubSettings:
    """EngineArgs' defaults for adapter downloads (lora_download_timeout, max_lora_download_bytes)."""
    from loraledger.engine_args import EngineArgs

    return adapter_settings(EngineArgs(model="-"))


async def _in_worker(load):
    """load() in an anyio worker thread, its result handed back through a list the loop empties.

    A worker keeps a job's return value (or exception) referenced for a moment after the loop has
    it; if the engine shuts down meanwhile and the interpreter exits, the checkpoint's tensors would
    be freed in that daemon thread during finalization, which aborts the process (ModelRunner.close
    tells the story). Through the list, the worker returns None and the loop holds the only reference.
    """
    box: list = []
    try:
        await anyio.to_thread.run_sync(_run_into, box, load)
        outcome = box.pop()
    finally:
        box.clear()  # cancelled mid-load: free it here, on the loop
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def _run_into(box: list, load) -> None:
    try:
        box.append(load())
    except Exception as exc:  # raised again on the loop by _in_worker
        box.append(exc)
