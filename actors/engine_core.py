"""EngineCore: builds the actors, wires their bounded inboxes together, starts them in one task group, stops them in order."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from loraledger.actors.adapter_loader import AdapterLoader
from loraledger.actors.admission import Admission
from loraledger.actors.audit_writer import AuditWriter
from loraledger.actors.executor import Executor
from loraledger.actors.lease_keeper import LeaseKeeper
from loraledger.actors.messages import AuditAppend, Shutdown
from loraledger.actors.output_assembler import OutputAssembler
from loraledger.actors.scheduler import Scheduler
from loraledger.logging import get_logger
from loraledger.scheduling.scheduler_config import SchedulerConfig
from loraledger.sources.engine_sources import adapter_settings
from loraledger.store.records import EventKind, EventRecord
from loraledger.structured_outputs.grammar_compiler import GrammarCompiler

# inbox sizes: large enough that no actor cycle (scheduler <-> assembler, assembler <-> audit) can fill
# both directions under normal load, small enough that a stalled consumer is felt upstream
INBOX = {
    "admission": 1024,
    "loader": 256,
    "scheduler": 4096,
    "executor": 2,
    "assembler": 8192,
    "audit": 16384,
    "lease": 4,
}


@dataclass
class EngineSetup:
    """Everything the actors need, prepared by the facade before start (model config, tokenizer, store, ...)."""

    args: object  # EngineArgs
    model_config: object  # ModelConfig
    tokenizer: object
    max_model_len: int
    num_kv_blocks: int
    base_model_fingerprint: str
    make_runner: object  # () -> ModelRunner, called in the executor's worker thread
    store: object | None  # an opened AuditStore, or None with auditing off
    async_scheduling: bool = False  # EngineArgs.async_scheduling, resolved for the device
    max_n: int = 128  # EngineArgs.max_n resolved for this cache (EngineArgs.resolved_max_n)
    tokenizers: object = None  # TokenizerGroup: the base tokenizer (or None) and the ones adapters ship
    generation: object = None  # GenerationDefaults read from the model's generation_config.json (or none)


class EngineCore:
    def __init__(self, setup: EngineSetup) -> None:
        self.setup = setup
        self._log = get_logger("engine_core")
        self._streams = {name: anyio.create_memory_object_stream[object](size) for name, size in INBOX.items()}
        self._done: dict[str, anyio.Event] = {name: anyio.Event() for name in INBOX}
        self._scopes: dict[
            str, anyio.CancelScope
        ] = {}  # each actor's own: cancelling them leaves the caller's code running
        self.runner = None
        # counters the loader and the audit writer publish (read by AsyncEngine.get_metrics, never written there)
        self.loader_stats = None
        self.grammars = None  # GrammarCompiler (admission's), None without a tokenizer
        self.audit_stats = None
        self.lease_stats = None
        self.fatal: BaseException | None = None  # the error that stopped the engine, if one did

    def sender(self, name: str) -> MemoryObjectSendStream:
        """A new handle on an actor's inbox (each holder closes its own clone)."""
        return self._streams[name][0].clone()

    async def start(self, tg) -> None:
        s = self.setup
        args = s.args
        audit_on = s.store is not None
        send = self.sender
        recv = {name: pair[1] for name, pair in self._streams.items()}

        if audit_on:
            writer = AuditWriter(
                recv["audit"], send("assembler"), s.store, on_failure=args.audit_on_failure, timeout=args.audit_timeout
            )
            self.audit_stats = writer.stats
            await tg.start(self._supervise, "audit", writer)
            keeper = LeaseKeeper(recv["lease"], s.store, lease_seconds=args.audit_lease_seconds)
            self.lease_stats = keeper.stats
            await tg.start(self._supervise, "lease", keeper)
        executor = Executor(recv["executor"], send("scheduler"), s.make_runner)
        self.runner = await tg.start(self._supervise, "executor", executor)
        config = SchedulerConfig(
            num_kv_blocks=s.num_kv_blocks,
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=s.max_model_len,
            max_loras=args.max_loras,
            eos_token_ids=_eos_ids(s.model_config, s.tokenizer),
            seed=args.seed,
            depth=2 if s.async_scheduling else 1,
            extra_stop_ids=s.generation.eos_token_ids if s.generation is not None else (),
            vocab_size=s.model_config.vocab_size,
            chunked_prefill=args.chunked_prefill,
        )
        scheduler = Scheduler(
            recv["scheduler"], send("executor"), send("assembler"), send("audit") if audit_on else None, config
        )
        await tg.start(self._supervise, "scheduler", scheduler)
        assembler = OutputAssembler(
            recv["assembler"],
            send("scheduler"),
            send("admission"),
            send("audit") if audit_on else None,
            durable=args.audit_durable,
        )
        await tg.start(self._supervise, "assembler", assembler)
        loader = AdapterLoader(
            recv["loader"],
            send("audit") if audit_on else None,
            send("scheduler"),
            model_config=s.model_config,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.cpu_lora_capacity,
            max_loras=args.max_loras,
            base_model_fingerprint=s.base_model_fingerprint,
            hub_settings=functools.partial(adapter_settings, args),
        )
        self.loader_stats = loader.stats
        await tg.start(self._supervise, "loader", loader)
        if s.tokenizer is not None:
            self.grammars = GrammarCompiler(s.model_config.vocab_size, _eos_ids(s.model_config, s.tokenizer))
        admission = Admission(
            recv["admission"],
            send("loader"),
            send("scheduler"),
            send("assembler"),
            send("audit") if audit_on else None,
            tokenizers=s.tokenizers,
            vocab_size=s.model_config.vocab_size,
            max_model_len=s.max_model_len,
            enable_lora=args.enable_lora,
            audit_prompts=args.audit_prompts,
            base_model_fingerprint=s.base_model_fingerprint,
            grammars=self.grammars,
        )
        await tg.start(self._supervise, "admission", admission)
        await self.record(
            EventKind.ENGINE_STARTED, {"base_model_fingerprint": s.base_model_fingerprint, "model": str(args.model)}
        )

    async def _supervise(self, name: str, actor, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Run one actor. Each actor fails only the request whose message it could not handle; an exception
        that escapes an actor is a broken engine invariant: the engine stops (every actor is cancelled, and
        their clean-up ends every pending request with EngineDeadError), but the caller's code around the
        engine is not cancelled, and new requests are refused with EngineDeadError naming the failure."""
        started = _Started(task_status)
        try:
            with anyio.CancelScope() as scope:
                self._scopes[name] = scope
                await actor.run(task_status=started)
        except Exception as exc:
            if not started.done:
                raise  # a failure to start is the caller's error, raised from start()
            self._log.critical(
                "actor failed; the engine stops", name=name, error=f"{type(exc).__name__}: {exc}", exc_info=exc
            )
            if self.fatal is None:
                self.fatal = exc
            for scope in self._scopes.values():
                scope.cancel()
        finally:
            self._done[name].set()
            self._log.debug("actor stopped", name=name)

    async def record(self, kind: str, payload: dict, request_id: str | None = None) -> None:
        if self.setup.store is None:
            return
        try:
            async with self.sender("audit") as audit:
                await audit.send(
                    AuditAppend(events=[EventRecord(kind=kind, at=time.time(), request_id=request_id, payload=payload)])
                )
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            # the writer has stopped (a fatal error stopped every actor): the event cannot be on record
            self._log.warning("engine event not recorded: the audit writer has stopped", kind=kind)

    def audit_queue_depth(self) -> int:
        """Audit messages not yet committed: waiting in the writer's inbox, and taken into its next commit."""
        if self.audit_stats is None:
            return 0
        waiting = self._streams["audit"][1].statistics().current_buffer_used
        return waiting + self.audit_stats.held

    async def stop(self, timeout: float | None = None) -> None:
        """Stop in dependency order: nothing new comes in, running requests end with an error, records are flushed.

        Bounded by timeout (default: the shutdown_timeout engine argument). Past it, every actor still
        waiting (on an audit store that does not answer, say) is cancelled: a final output whose
        records were not committed is withheld and its caller gets an error, and the next start
        records those requests as interrupted, as after a crash.
        """
        if timeout is None:
            timeout = getattr(self.setup.args, "shutdown_timeout", 30.0)
        with anyio.move_on_after(timeout, shield=True) as scope:
            for name in ("admission", "scheduler", "loader", "assembler"):
                await self._shutdown(name)
            if self.setup.store is not None:
                await self.record(EventKind.ENGINE_STOPPED, {})
                await self._shutdown("audit")
                await self._shutdown("lease")  # last: the lease is released once everything is on record
        if scope.cancelled_caught:
            waiting = sorted(name for name, done in self._done.items() if not done.is_set())
            self._log.error(
                "engine stop timed out: cancelling the actors still running", timeout=timeout, actors=waiting
            )
            for scope in self._scopes.values():
                scope.cancel()
        # our own inbox handles: with them gone the Executor (whose only other sender was the Scheduler) ends too.
        # An actor closes its inbox when it ends; one never started (the audit writer and lease keeper with auditing
        # off) has its inbox closed here, or the interpreter warns of it at exit
        for name, (send, receive) in self._streams.items():
            send.close()
            if name not in self._scopes:
                receive.close()

    async def _shutdown(self, name: str) -> None:
        if self._done[name].is_set():
            return
        try:
            async with self.sender(name) as inbox:
                await inbox.send(Shutdown())
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        await self._done[name].wait()


class _Started:
    """A TaskStatus that remembers whether the actor reported ready."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.done = False

    def started(self, value=None) -> None:
        self.done = True
        self._inner.started(value)


def _eos_ids(model_config, tokenizer) -> tuple[int, ...]:
    ids = set(model_config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))
