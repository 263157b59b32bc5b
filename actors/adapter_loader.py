"""AdapterLoader actor: a shell over loraledger.lora that reads adapters in worker threads, caches and pins them."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext

import anyio
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from loraledger.actors.failures import request_error
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
from loraledger.actors.replies import answer
from loraledger.errors import (
    AdapterError,
    EngineDeadError,
    LoraLedgerError,
    LoRARequestConflictError,
    TooManyLoRAsError,
    UnknownRequestError,
)
from loraledger.gpu.model_config import ModelConfig
from loraledger.logging import get_logger
from loraledger.lora.checkpoint import LoraCheckpoint
from loraledger.lora.checkpoint_reader import load_lora_checkpoint
from loraledger.lora.host_cache import HostCache
from loraledger.lora.registry import AdapterRegistry
from loraledger.lora.request import LoRARequest
from loraledger.sources import HubSettings, resolve
from loraledger.sources.engine_sources import adapter_settings
from loraledger.sources.fileset import ADAPTER
from loraledger.store.records import EventKind, EventRecord


class AdapterLoaderStats:
    """Counters the AdapterLoader publishes (it alone writes them, on the event loop), by adapter name."""

    def __init__(self) -> None:
        self.loads: Counter[str] = Counter()  # adapters read from disk into the host cache
        self.evictions: Counter[str] = Counter()  # adapters dropped from the host cache (LRU, max_cpu_loras)
        self.failures: Counter[str] = Counter()  # loads that failed


class AdapterLoader:
    """Owns the adapter registry, the host cache and pinning; a load runs in a worker thread, one per adapter at a time
    (later askers wait for the same load), and its outcome is put on record."""

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
        self._base_fp = base_model_fingerprint
        self._hub_settings = hub_settings or _default_hub_settings
        self._commits: dict[tuple[int, str], str] = {}  # (lora_int_id, lora_path) -> the Hub commit it was read at
        self._registry = AdapterRegistry()
        self._cache = HostCache(max_cpu_loras, max_pinned=max_loras)
        self._loading: dict[int, list[MemoryObjectSendStream]] = {}  # lora_int_id -> who waits for its load
        self._tg: TaskGroup | None = None  # the loads' and pins' tasks, while run() lasts
        self.stats = AdapterLoaderStats()
        self._log = get_logger("adapter_loader")

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        async with self._inbox, self._scheduler, self._audit or nullcontext(), anyio.create_task_group() as self._tg:
            task_status.started()
            async for msg in self._inbox:
                if isinstance(msg, Shutdown):
                    break
                try:
                    await self._handle(msg)
                # the failure boundary: this message's asker gets the error, the loader goes on
                except Exception as exc:
                    self._log.exception("message not handled", kind=type(msg).__name__)
                    await self._answer_error(msg, exc)
            self._tg.cancel_scope.cancel()

    async def _handle(self, msg) -> None:
        match msg:
            case ResolveAdapter(lora_request=lora, reply=reply, resumed=resumed, at_commit=at_commit):
                self._resolve(self._resumed_as(lora, at_commit) if resumed else lora, reply)
            case AddLora(lora_request=lora, reply=reply):
                self._resolve(lora, reply)
            case RemoveLora(lora_int_id=int_id, reply=reply):
                await self._remove(int_id, reply)
            case PinLora(lora_int_id=int_id, reply=reply):
                await self._pin(int_id, reply)
            case ListLoras(reply=reply):
                await answer(reply, self._registry.ids())

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

    def _resumed_as(self, lora: LoRARequest, at_commit: str | None) -> LoRARequest:
        """A resumed request's adapter as registered here. With the Hub commit its binding names: a registration read
        at that commit (the one of the same name and path, when it was; else one of its own, read at that commit),
        so a branch that moved since does not change what the request resumes on."""
        resumed = self._registry.for_resume(lora)
        if at_commit is None:
            return resumed
        for int_id in self._registry.ids_of(lora.lora_name, lora.lora_path):
            if self._commits.get((int_id, lora.lora_path)) == at_commit:
                return LoRARequest(lora.lora_name, int_id, lora.lora_path)
        if resumed.lora_int_id in self._registry:  # registered here, read at another commit (or being read)
            resumed = LoRARequest(lora.lora_name, self._registry.free_resumed_id(), lora.lora_path)
        self._commits[(resumed.lora_int_id, lora.lora_path)] = at_commit  # its reads are at the bound commit
        return resumed

    # --- resolving: the cached checkpoint, or one load shared by everyone who asks meanwhile --------

    def _resolve(self, lora: LoRARequest, reply: MemoryObjectSendStream) -> None:
        try:
            self._registry.register(lora)
        except LoRARequestConflictError as exc:
            self._tg.start_soon(answer, reply, AdapterResolved(lora_request=lora, error=exc))
            return
        waiters = self._loading.get(lora.lora_int_id)
        if waiters is not None:  # a load of this adapter is already running (an in-place reload too): share it
            waiters.append(reply)
            return
        if lora.load_inplace:
            # vLLM's in-place reload: read the folder again. Requests admitted before keep the checkpoint they were
            # bound to (its device slot and prefix-cache blocks are keyed by its fingerprint, the new content's by
            # its own), so nothing running changes under them.
            self._cache.discard(lora.lora_int_id)
        cached = self._cache.get(lora.lora_int_id)
        if cached is not None:
            self._tg.start_soon(answer, reply, AdapterResolved(lora_request=lora, checkpoint=cached))
            return
        self._loading[lora.lora_int_id] = [reply]
        self._tg.start_soon(self._load, lora)

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
        evicted = self._cache.put(lora.lora_int_id, ckpt)
        if ckpt.source is not None and ckpt.source.commit is not None:
            self._commits[(lora.lora_int_id, lora.lora_path)] = ckpt.source.commit
        self.stats.loads[lora.lora_name] += 1
        for old in evicted:
            await self._evicted(old)
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
        self._cache.discard(lora.lora_int_id)
        self._registry.forget(lora)
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

    async def _evicted(self, ckpt: LoraCheckpoint) -> None:
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

    # --- removing and pinning ----------------------------------------------------------------

    async def _remove(self, int_id: int, reply) -> None:
        removed = self._registry.remove(int_id)
        if removed is None:
            await answer(reply, False)
            return
        self._commits.pop((int_id, removed.lora_path), None)
        self._cache.unpin(int_id)
        ckpt = self._cache.discard(int_id)
        if ckpt is not None:
            try:
                await self._scheduler.send(UnpinSlot(fingerprint=ckpt.fingerprint))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
        await answer(reply, True)

    async def _pin(self, int_id: int, reply) -> None:
        """Pin end to end: the adapter is loaded if need be and kept in host memory and in a device slot until it is
        removed. The answer (True, or the error) comes once the scheduler holds the slot."""
        lora = self._registry.get(int_id)
        if lora is None:
            await answer(
                reply, UnknownRequestError(f"no adapter with lora_int_id {int_id} is registered; add_lora() it first")
            )
            return
        was_pinned = self._cache.is_pinned(int_id)
        try:
            self._cache.pin(int_id)  # before the load ends, so the host cache cannot evict what is being pinned
        except TooManyLoRAsError as exc:
            await answer(reply, exc)
            return
        resolved_send, resolved = anyio.create_memory_object_stream[AdapterResolved](1)
        try:
            self._resolve(lora, resolved_send)
        except Exception:
            if not was_pinned:
                self._cache.unpin(int_id)
            raise
        self._tg.start_soon(self._pin_slot, int_id, was_pinned, resolved, reply)

    async def _pin_slot(self, int_id: int, was_pinned: bool, resolved, reply) -> None:
        outcome: object = EngineDeadError("the engine stopped before the adapter was pinned")
        try:
            async with resolved:
                got: AdapterResolved = await resolved.receive()
            if got.error is not None:
                outcome = got.error
                return
            ckpt = got.checkpoint
            slot_send, slot_answer = anyio.create_memory_object_stream[object](1)
            try:
                await self._scheduler.send(PinSlot(fingerprint=ckpt.fingerprint, checkpoint=ckpt, reply=slot_send))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return
            async with slot_answer:
                outcome = await slot_answer.receive()
        except anyio.EndOfStream:
            pass
        finally:
            if isinstance(outcome, BaseException) and not was_pinned:
                self._cache.unpin(int_id)  # a pin that failed holds nothing
            await answer(reply, outcome)


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
