"""Admission actor: validates and tokenizes requests, resolves their adapter, and fixes the binding on record.

The binding (request id <-> LoRARequest as submitted <-> adapter fingerprint) is written to the
audit log, and committed, before the request reaches the Scheduler: no compute happens for a
request that is not on record. A request refused here produces no output, only its error.
"""

from __future__ import annotations

import contextlib
import functools
import time
from contextlib import nullcontext

import anyio
import msgspec
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from loraledger.actors.failures import request_error
from loraledger.actors.messages import (
    Abort,
    Accepted,
    AdapterResolved,
    AuditAppend,
    NewRequest,
    RequestDone,
    RequestFailed,
    ResolveAdapter,
    Shutdown,
    Submit,
    TrackRequest,
)
from loraledger.actors.replies import deliver, deliver_last
from loraledger.digests import binding_digest, prompt_digest, tools_digest
from loraledger.errors import (
    AdapterChangedError,
    DuplicateRequestError,
    EngineDeadError,
    LoraLedgerError,
    NoTokenizerError,
    RequestErasedError,
)
from loraledger.input_processor import INLINE_TOKENIZE_CHARS, check_model_inputs, shown_id
from loraledger.logging import get_logger, request_logger
from loraledger.sources.engine_sources import adapter_fields, tokenizer_lora
from loraledger.store.records import (
    CONSTRAINT,
    PROMPT,
    TOOLS,
    EventKind,
    EventRecord,
    RequestRecord,
    recordable,
    salted_content,
    salted_text,
    text_commitments,
)
from loraledger.tool_calls import reading_of
from loraledger.version import __version__


class Admission:
    def __init__(
        self,
        inbox: MemoryObjectReceiveStream,
        loader: MemoryObjectSendStream,
        scheduler: MemoryObjectSendStream,
        assembler: MemoryObjectSendStream,
        audit: MemoryObjectSendStream | None,
        *,
        tokenizers,
        vocab_size: int,
        max_model_len: int,
        enable_lora: bool,
        audit_prompts: str,
        base_model_fingerprint: str,
        grammars=None,
    ) -> None:
        self._inbox = inbox
        self._loader = loader
        self._scheduler = scheduler
        self._assembler = assembler
        self._audit = audit
        self._tokenizers = tokenizers  # TokenizerGroup: the model's tokenizer (or none) and the ones adapters ship
        self._vocab_size = vocab_size
        self._max_model_len = max_model_len
        self._enable_lora = enable_lora
        self._audit_prompts = audit_prompts
        self._base_fp = base_model_fingerprint
        self._grammars = grammars  # GrammarCompiler: structured_outputs compiled once per distinct constraint
        self._in_flight: dict[str, str] = {}  # audit key -> caller id: admitted or being admitted, not yet released
        # caller id -> the audit key of the live request holding it; freed when that request ends or is aborted
        # (vLLM: a caller may reuse an id once its request is finished or aborted; only two live ones clash)
        self._live_callers: dict[str, str] = {}
        self._admitting: dict[str, object] = {}  # request id -> caller channel, while being admitted
        self._abort_on_admit: set[str] = set()
        self._log = get_logger("admission")

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        async with self._inbox, self._loader, self._scheduler, self._assembler, self._audit or nullcontext():
            try:
                async with anyio.create_task_group() as tg:
                    task_status.started()
                    await self._serve(tg)
                    tg.cancel_scope.cancel()
            finally:
                # shut down, or torn down by another actor's failure: nobody is left waiting for an answer
                with anyio.move_on_after(5, shield=True):
                    for rid, channel in self._admitting.items():
                        await deliver_last(
                            channel, rid, EngineDeadError(f"the engine stopped while admitting request {rid!r}")
                        )

    async def _serve(self, tg) -> None:
        async for msg in self._inbox:
            if isinstance(msg, Shutdown):
                return
            try:
                await self._handle(tg, msg)
            except Exception as exc:  # the failure boundary: this message's request fails, admission goes on
                rid = getattr(msg, "request_id", None)
                self._log.exception("message not handled", kind=type(msg).__name__, request_id=rid)
                if isinstance(msg, Submit):
                    self._forget(rid, msg.channel)
                    await deliver_last(msg.channel, rid, request_error(exc, shown_id(msg), "admission", audit_id=rid))

    async def _handle(self, tg, msg) -> None:
        match msg:
            case Submit(request_id=rid):
                # a resumed request holds its audit key, not its caller id: that id may be a newer request's by now
                caller = rid if msg.resume else msg.caller_request_id or rid
                if caller in self._live_callers or rid in self._in_flight:
                    await deliver_last(
                        msg.channel,
                        rid,
                        DuplicateRequestError(
                            f"request id {caller!r} is already in use by a request that has not finished; "
                            "use a new id, or reuse this one once that request has finished or been aborted"
                        ),
                    )
                    return
                self._in_flight[rid] = caller
                self._live_callers[caller] = rid
                self._admitting[rid] = msg.channel
                tg.start_soon(self._admit, msg)
            case Abort(request_ids=callers, audit_ids=keys):
                ids = [self._live_callers.pop(c) for c in callers if c in self._live_callers]
                for rid in keys:
                    if rid in self._in_flight:
                        self._free_caller(rid)
                        ids.append(rid)
                pending = [rid for rid in ids if rid in self._admitting]
                self._abort_on_admit.update(pending)
                rest = [rid for rid in ids if rid not in self._admitting]
                if rest:
                    await self._scheduler.send(Abort(audit_ids=rest))
            case RequestDone(audit_id=rid):
                self._free_caller(rid)
                self._in_flight.pop(rid, None)

    def _free_caller(self, rid: str) -> None:
        """The caller id request `rid` holds may be used again (it may already hold a newer request: leave that)."""
        caller = self._in_flight.get(rid)
        if caller is not None and self._live_callers.get(caller) == rid:
            del self._live_callers[caller]

    def _forget(self, rid: str, channel) -> None:
        """Drop a request that will not reach the Scheduler from admission's bookkeeping."""
        if self._admitting.get(rid) is channel:
            del self._admitting[rid]
            self._free_caller(rid)
            self._in_flight.pop(rid, None)
            self._abort_on_admit.discard(rid)

    async def _admit(self, msg: Submit) -> None:
        """Check, resolve and bind one request, then hand it on. Whatever it raises fails this request only."""
        rid = msg.request_id
        shown = shown_id(msg)
        lora = msg.lora_request
        log = request_logger(self._log, rid, lora.lora_name if lora else None)
        bound = False
        try:
            ckpt = None
            if lora is not None:
                try:
                    resolved, ckpt = await self._resolve(lora, resumed=msg.resume, at_commit=msg.bound_commit)
                except LoraLedgerError as exc:
                    if msg.resume:  # its adapter cannot be had (its bound commit is gone from the Hub and the cache)
                        await self._refuse_resume(
                            msg, bound_commit=msg.bound_commit, error=f"{type(exc).__name__}: {exc}"
                        )
                    raise
                if msg.resume:
                    lora = resolved  # under this engine's id for it (its binding's id was another engine's handle)
            # after the adapter: a Hub adapter's tokenizer files are in the snapshot its load fetched
            tokenizer = await self._tokenizer_for(tokenizer_lora(lora, ckpt))
            inputs = await self._model_inputs(msg, tokenizer)
            prompt_ids, constraint = inputs.prompt_token_ids, inputs.constraint
            grammar = await self._grammar_for(constraint, tokenizer)
            fingerprint = ckpt.fingerprint if ckpt is not None else None
            if msg.resume:
                await self._record_resume(msg, fingerprint)
            elif self._audit is not None:
                await self._record_binding(msg, prompt_ids, ckpt, constraint)
                bound = True
        except Exception as exc:
            error = request_error(exc, shown, "admission", audit_id=rid)
            if error is exc:
                log.info("request refused", error=str(exc), error_type=type(exc).__name__)
            else:
                log.error("admission failed", error=repr(exc), exc_info=exc)
            self._forget(rid, msg.channel)
            if bound:  # on record as admitted: its end must be on record too
                await self._record_failed(rid, error)
            await deliver_last(msg.channel, rid, error)
            return
        queued = time.time()
        tracked = False
        try:
            await self._assembler.send(
                TrackRequest(
                    audit_id=rid,
                    prompt=msg.prompt,
                    prompt_token_ids=prompt_ids,
                    params=msg.params,
                    lora_request=lora,
                    adapter_fingerprint=fingerprint,
                    arrival_time=msg.arrival_time,
                    queued_time=queued,
                    channel=msg.channel,
                    tokenizer=tokenizer if msg.params.detokenize else None,
                    caller_request_id=msg.caller_request_id or rid,
                    tool_calls=msg.tool_calls,
                )
            )
            tracked = True
            await deliver(msg.channel, rid, Accepted(request_id=rid, adapter_fingerprint=fingerprint))
            await self._scheduler.send(
                NewRequest(
                    audit_id=rid,
                    prompt_token_ids=prompt_ids,
                    params=msg.params,
                    lora_request=lora,
                    checkpoint=ckpt,
                    arrival_time=msg.arrival_time,
                    queued_time=queued,
                    bad_words_token_ids=inputs.bad_words_token_ids,
                    caller_request_id=msg.caller_request_id,
                    grammar=grammar,
                    cache_salt=msg.cache_salt,
                )
            )
        except Exception as exc:
            error = request_error(exc, shown, "admission", audit_id=rid)
            log.error("handing the request on failed", error=repr(exc), exc_info=exc)
            self._forget(rid, msg.channel)
            if tracked:  # the OutputAssembler ends it: records the failure, tells the caller, frees the id
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await self._assembler.send(RequestFailed(audit_id=rid, error=error))
            else:
                if bound:
                    await self._record_failed(rid, error)
                await deliver_last(msg.channel, rid, error)
            return
        self._admitting.pop(rid, None)
        if rid in self._abort_on_admit:
            self._abort_on_admit.discard(rid)
            await self._scheduler.send(Abort(audit_ids=[rid]))
        log.debug("admitted", prompt_tokens=len(prompt_ids), fingerprint=(fingerprint or "")[:12])

    async def _record_failed(self, rid: str, error: BaseException) -> None:
        """A request_failed event for a request whose binding is on record but that never reached the Scheduler."""
        if self._audit is None:
            return
        event = EventRecord(
            kind=EventKind.REQUEST_FAILED,
            at=time.time(),
            request_id=rid,
            payload={"error": f"{type(error).__name__}: {error}"},
            dedup_key=f"end:{rid}",
        )
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self._audit.send(AuditAppend(events=[event]))

    async def _grammar_for(self, constraint, tokenizer):
        """The compiled grammar of the request's constraint (None without one), compiled in a worker thread
        unless the cache has it; a constraint that does not compile fails this request with StructuredOutputError."""
        if constraint is None:
            return None
        if self._grammars is None:
            raise NoTokenizerError(
                "structured_outputs needs the model's tokenizer (the grammar is matched against its vocabulary), and this "
                "engine was built with skip_tokenizer_init=True"
            )
        return await anyio.to_thread.run_sync(self._grammars.compile, constraint, tokenizer)

    async def _tokenizer_for(self, lora):
        """The request's tokenizer: its adapter's own (read off the event loop the first time) or the model's."""
        if self._tokenizers is None:
            return None
        if self._tokenizers.cached(lora):
            return self._tokenizers.get(lora)
        return await anyio.to_thread.run_sync(self._tokenizers.get, lora)

    async def _model_inputs(self, msg: Submit, tokenizer):
        """The input processor's model checks; a long text prompt is tokenized off the event loop."""
        check = functools.partial(
            check_model_inputs,
            msg,
            tokenizer,
            vocab_size=self._vocab_size,
            max_model_len=self._max_model_len,
            enable_lora=self._enable_lora,
        )
        if msg.prompt_token_ids is None and isinstance(msg.prompt, str) and len(msg.prompt) > INLINE_TOKENIZE_CHARS:
            return await anyio.to_thread.run_sync(check)
        return check()

    async def _resolve(self, lora, *, resumed: bool = False, at_commit: str | None = None):
        """The adapter as the loader registered it, and its checkpoint (a resumed request's: at its bound commit)."""
        send, receive = anyio.create_memory_object_stream[AdapterResolved](1)
        await self._loader.send(ResolveAdapter(lora_request=lora, reply=send, resumed=resumed, at_commit=at_commit))
        async with receive:
            answer = await receive.receive()
        if answer.error is not None:
            raise answer.error
        return answer.lora_request, answer.checkpoint

    async def _record_resume(self, msg: Submit, fingerprint: str | None) -> None:
        """A resumed request runs under its original binding, or not at all."""
        rid = msg.request_id
        if fingerprint != msg.bound_fingerprint:
            await self._refuse_resume(msg, fingerprint_on_disk=fingerprint)
            lora = msg.lora_request
            raise AdapterChangedError(
                f"request {rid!r} was bound to adapter fingerprint {msg.bound_fingerprint}, but the adapter on disk now has "
                f"{fingerprint}; it is not resumed (the refusal is on record)",
                lora_name=lora.lora_name if lora else None,
                lora_path=lora.lora_path if lora else None,
            )
        payload = {} if msg.resume_note is None else {"tool_calls_not_read": msg.resume_note}
        event = EventRecord(
            kind=EventKind.REQUEST_RESUMED, at=time.time(), request_id=rid, payload=payload, dedup_key=f"resumed:{rid}"
        )
        try:
            await self._append_and_wait(AuditAppend(events=[event]))
        except RequestErasedError as exc:
            # its text was erased after it was interrupted: it gets no new text, so it does not run (store/texts.py)
            await self._refuse_resume(msg, erased=str(exc))
            raise

    async def _refuse_resume(self, msg: Submit, **why) -> None:
        """The resume_refused event of a resumed request that does not run: why, beside the fingerprint it was bound to."""
        if self._audit is None:
            return
        rid = msg.request_id
        event = EventRecord(
            kind=EventKind.RESUME_REFUSED,
            at=time.time(),
            request_id=rid,
            payload={"bound_fingerprint": msg.bound_fingerprint, **why},
            dedup_key=f"resume-refused:{rid}",
        )
        await self._append_and_wait(AuditAppend(events=[event]))

    async def _append_and_wait(self, msg: AuditAppend) -> None:
        send, receive = anyio.create_memory_object_stream[object](1)
        await self._audit.send(msgspec.structs.replace(msg, reply=send))
        async with receive:
            outcome = await receive.receive()
        if outcome is not None:
            raise outcome

    def _caller_content(self, rid: str, spec, constraint) -> tuple[dict, list]:
        """The binding's fields for its tools and constraint, and their text rows: the digests, how the calls are read,
        and, where prompts are audited as text (tools and schemas say as much), each text kept apart under a salt and
        committed to (tools_text / constraint_text stay None, so `audit erase` can remove the text)."""
        fields: dict = {}
        kept = []
        keep = self._audit_prompts == "text"
        if spec is not None:
            text = spec.canonical_tools()
            fields.update(tools_sha256=tools_digest(text), tool_reading=reading_of(spec))
            if keep:
                row, fields["tools_commitment"] = salted_content(rid, TOOLS, 0, recordable(text))
                kept.append(row)
        if constraint is not None:
            fields.update(constraint_kind=constraint.kind, constraint_sha256=constraint.sha256)
            if keep:
                row, fields["constraint_commitment"] = salted_content(
                    rid, CONSTRAINT, 0, recordable(constraint.canonical)
                )
                kept.append(row)
        return fields, kept

    async def _record_binding(self, msg: Submit, prompt_ids: list[int], ckpt, constraint) -> None:
        lora = msg.lora_request
        prompt_text = msg.prompt if msg.prompt is not None else None
        prompt_hash = prompt_digest(prompt_text, prompt_ids)
        # a prompt kept as text goes to `request_texts` under a salt; the binding commits to it (so it can be erased)
        kept = None
        if self._audit_prompts == "text":
            kept = salted_text(msg.request_id, PROMPT, 0, recordable(prompt_text), prompt_ids)
        committed = text_commitments(kept) if kept is not None else (None, None)
        content, content_rows = self._caller_content(msg.request_id, msg.tool_calls, constraint)
        binding = RequestRecord(
            request_id=msg.request_id,
            adapter_fingerprint=ckpt.fingerprint if ckpt is not None else None,
            lora_name=lora.lora_name if lora else None,
            lora_int_id=lora.lora_int_id if lora else None,
            lora_path=lora.lora_path if lora else None,
            tenant=recordable(msg.tenant),
            sampling_params=_recordable_params(msg.params),
            prompt_text=None,  # kept in `request_texts` (above), never in the binding the chain holds
            prompt_sha256=None if self._audit_prompts == "none" else prompt_hash,
            prompt_token_count=len(prompt_ids),
            received_at=msg.arrival_time,
            engine_version=__version__,
            base_model_fingerprint=self._base_fp,
            key_id=msg.key_id,
            caller_request_id=recordable(msg.caller_request_id or msg.request_id),
            chat_template_sha256=msg.chat_template_sha256,
            **adapter_fields(ckpt.source if ckpt is not None else None, prefix="adapter_"),
            prompt_commitment=committed[0],
            prompt_token_ids_commitment=committed[1],
            **content,
        )
        payload = {"binding": msgspec.to_builtins(binding), "binding_sha256": binding_digest(binding)}
        if msg.user is not None:
            payload["caller"] = {"user": recordable(msg.user)}
        event = EventRecord(
            kind=EventKind.REQUEST_ADMITTED,
            at=time.time(),
            request_id=msg.request_id,
            payload=payload,
            dedup_key=f"admit:{msg.request_id}",
        )
        await self._append_and_wait(
            AuditAppend(
                adapters=[ckpt.to_record(self._base_fp, time.time())] if ckpt is not None else [],
                requests=[binding],
                events=[event],
                # the prompt's token ids let a resumed request re-run it; its tools and constraint, read it as before
                texts=([kept] if kept is not None else []) + content_rows,
                admission=True,
            )
        )


def _recordable_params(params) -> dict:
    """Sampling params as builtins, stop strings made recordable like every other text. structured_outputs is not
    among them: the binding's constraint_kind, constraint_sha256 and (per audit_prompts) its constraint_commitment to
    the canonical text kept in `request_texts` record it exactly (that text escapes what a database's JSON could not
    hold)."""
    out = msgspec.to_builtins(params)
    out.pop("structured_outputs", None)
    for name in ("stop", "bad_words"):
        if out.get(name):
            out[name] = [recordable(s) for s in out[name]]
    return out
