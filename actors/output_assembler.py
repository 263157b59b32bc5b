"""OutputAssembler actor: detokenizes, applies stop strings, builds RequestOutputs and streams them to callers.

A request's final output goes to the caller only after its completion rows are committed to the
audit store (audit_durable, the default): it is held here until the AuditWriter says so.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field

import anyio
import msgspec
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from loraledger.actors.detokenizer import Detokenizer
from loraledger.actors.failures import request_error
from loraledger.actors.messages import (
    Abort,
    AuditAppend,
    AuditCommitted,
    AuditRefused,
    RequestDone,
    RequestFailed,
    Shutdown,
    StepTokens,
    StopSeq,
    TrackRequest,
)
from loraledger.actors.replies import deliver, deliver_last
from loraledger.digests import completions_digest, stored_time
from loraledger.logging import get_logger, request_logger
from loraledger.outputs import CompletionOutput, Logprob, RequestOutput, RequestStateStats
from loraledger.sampling_params import RequestOutputKind, SamplingParams
from loraledger.store.records import (
    COMPLETION,
    CompletionRecord,
    EventKind,
    EventRecord,
    recordable,
    salted_text,
    text_commitments,
)
from loraledger.tool_calls import kept_calls


@dataclass(eq=False)
class _SeqOut:
    index: int
    detok: Detokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # DELTA bookkeeping
    sent_chars: int = 0
    dirty: bool = False
    stop_from: int = 0  # stop strings must end past this many characters (the text of the first min_tokens tokens)


@dataclass(eq=False)
class _ReqOut:
    msg: TrackRequest
    seqs: list[_SeqOut]
    metrics: RequestStateStats
    num_cached_tokens: int | None = None
    prompt_logprobs: list | None = None
    max_stop_len: int = 0
    final: RequestOutput | None = None  # held until its audit commit

    @property
    def params(self) -> SamplingParams:
        return self.msg.params


class OutputAssembler:
    def __init__(
        self,
        inbox: MemoryObjectReceiveStream,
        scheduler: MemoryObjectSendStream,
        admission: MemoryObjectSendStream,
        audit: MemoryObjectSendStream | None,
        *,
        durable: bool,
    ) -> None:
        """Each request brings its own tokenizer (TrackRequest.tokenizer: an adapter's own, or the model's)."""
        self._inbox = inbox
        self._scheduler = scheduler
        self._admission = admission
        self._audit = audit
        self._decoded: weakref.WeakKeyDictionary = (
            weakref.WeakKeyDictionary()
        )  # tokenizer -> {token id: its text alone}
        self._durable = durable and audit is not None
        self._reqs: dict[str, _ReqOut] = {}
        self._held: dict[str, _ReqOut] = {}
        self._step_time = 0.0  # the time of the StepTokens being handled
        self._log = get_logger("output_assembler")

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        async with self._inbox, self._scheduler, self._admission, self._audit or nullcontext():
            task_status.started()
            closing = False
            try:
                async for msg in self._inbox:
                    if isinstance(msg, Shutdown):
                        closing = True
                    else:
                        try:
                            await self._handle(msg)
                        except (
                            Exception
                        ) as exc:  # the failure boundary: this message's request fails, the assembler goes on
                            rid = getattr(msg, "audit_id", None)
                            self._log.exception("message not handled", kind=type(msg).__name__, request_id=rid)
                            if rid is not None:
                                await self._fail_quietly(rid, exc)
                    if closing and not self._held:
                        break  # every final output that was waiting for its audit commit is out
            finally:
                with anyio.move_on_after(5, shield=True):
                    await self._fail_pending()

    async def _handle(self, msg) -> None:
        match msg:
            case TrackRequest():
                self._track(msg)
            case StepTokens():
                await self._on_tokens(msg)
            case RequestFailed(audit_id=rid, error=error):
                await self._fail(rid, error)
            case AuditRefused(audit_ids=ids, error=error):
                for rid in ids:
                    req = self._held.pop(rid, None)
                    if req is not None:
                        await self._per_request(rid, self._refused(rid, req, error))
            case AuditCommitted(audit_ids=ids, receipts=receipts):
                for rid in ids:
                    req = self._held.pop(rid, None)
                    if req is not None:
                        if rid in receipts and isinstance(req.final, RequestOutput):
                            req.final.receipt = receipts[rid]
                        await self._per_request(rid, self._release(req))

    async def _per_request(self, rid: str, work) -> None:
        """Await one request's part of a message: if it raises, that request fails and the rest of the message goes on."""
        try:
            await work
        except Exception as exc:
            self._log.exception("request not handled", request_id=rid)
            await self._fail_quietly(rid, exc)

    async def _fail_quietly(self, rid: str, exc: BaseException, req: _ReqOut | None = None) -> None:
        """Fail request `rid` after `exc`: the caller gets a typed error, the Scheduler stops computing it.

        Called from the failure boundary, so it must not raise itself: a request it cannot reach any more
        (already released, or half torn down) is only logged."""
        try:
            req = self._reqs.get(rid) or self._held.pop(rid, None) or req
            error = request_error(
                exc, (req.msg.caller_request_id if req is not None else None) or rid, "output assembler", audit_id=rid
            )
            if req is not None and rid not in self._reqs:
                self._reqs[rid] = req  # held for its audit commit, or half finished: _fail ends it the same way
            await self._fail(rid, error)
            await _send_quietly(self._scheduler, Abort(audit_ids=[rid]))
        except Exception:
            self._log.exception("request could not be failed", request_id=rid)

    def _track(self, msg: TrackRequest) -> None:
        params = msg.params
        seqs = [
            _SeqOut(
                index=i,
                detok=Detokenizer(msg.tokenizer, msg.prompt_token_ids, params.skip_special_tokens),
                logprobs=[] if params.logprobs is not None else None,
            )
            for i in range(params.n)
        ]
        metrics = RequestStateStats(
            arrival_time=msg.arrival_time,
            queued_ts=msg.queued_time,
            adapter_name=msg.lora_request.lora_name if msg.lora_request else None,
            adapter_fingerprint=msg.adapter_fingerprint,
        )
        self._reqs[msg.audit_id] = _ReqOut(
            msg=msg, seqs=seqs, metrics=metrics, max_stop_len=max((len(s) for s in params.stop or ()), default=0)
        )

    async def _on_tokens(self, msg: StepTokens) -> None:
        # one request's update that raises fails that request; the others' tokens are handled as usual
        touched: dict[str, _ReqOut] = {}
        failed: dict[str, tuple[_ReqOut, BaseException]] = {}
        self._step_time = msg.time
        for timing in msg.timings:
            req = self._reqs.get(timing.audit_id)
            if req is None:
                continue
            try:
                self._on_timing(req, timing)
            except Exception as exc:
                failed.setdefault(timing.audit_id, (req, exc))
        for update in msg.updates:
            req = self._reqs.get(update.audit_id)
            if req is None or update.audit_id in failed:
                continue
            try:
                await self._on_update(req, update, touched)
            except Exception as exc:
                failed.setdefault(update.audit_id, (req, exc))
        now = time.time()
        for rid, req in touched.items():
            if rid in failed:
                continue
            try:
                if all(s.finish_reason is not None for s in req.seqs):
                    await self._finish(rid, req, now)
                elif req.params.output_kind != RequestOutputKind.FINAL_ONLY:
                    await self._deliver(req, self._snapshot(req, final=False))
            except Exception as exc:
                failed.setdefault(rid, (req, exc))
        for rid, (req, exc) in failed.items():
            self._log.error("request not handled", request_id=rid, error=repr(exc), exc_info=exc)
            await self._fail_quietly(rid, exc, req)

    def _on_timing(self, req: _ReqOut, timing) -> None:
        if timing.first_scheduled_time is not None and not req.metrics.scheduled_ts:
            req.metrics.scheduled_ts = timing.first_scheduled_time
        if timing.num_cached_tokens is not None and req.num_cached_tokens is None:
            req.num_cached_tokens = timing.num_cached_tokens
        if timing.preempted:
            req.metrics.num_preemptions += 1
        if timing.prompt_logprobs is not None:
            self._add_prompt_logprobs(req, timing.prompt_logprobs)

    async def _on_update(self, req: _ReqOut, update, touched: dict[str, _ReqOut]) -> None:
        seq = req.seqs[update.seq_index]
        if seq.finish_reason is not None:
            return  # a stop string already ended it; tokens of a step in flight are dropped
        touched[update.audit_id] = req
        seq.dirty = True
        if update.token_ids:
            metrics = req.metrics
            if not metrics.first_token_ts:
                metrics.first_token_ts = self._step_time
                metrics.first_token_latency = self._step_time - metrics.arrival_time
            metrics.last_token_ts = self._step_time
            metrics.num_generation_tokens += len(update.token_ids)
            done_before = len(seq.token_ids)
            seq.token_ids.extend(update.token_ids)
            seq.cumulative_logprob += sum(update.logprobs)
            if seq.logprobs is not None:
                self._add_logprobs(req, seq, update)
            # a token that ended the request (EOS or a stop token id) stays in token_ids; like vLLM, it shows in
            # the text only with include_stop_str_in_output, whatever skip_special_tokens says
            hide_last = update.finish_reason == "stop" and not req.params.include_stop_str_in_output
            visible = update.token_ids[:-1] if hide_last else update.token_ids
            before = len(seq.text)
            held = req.params.min_tokens - done_before  # tokens of this update still within min_tokens
            if held > 0:
                seq.text += seq.detok.add(visible[:held])
                seq.stop_from = len(seq.text)  # vLLM: a stop string must end after the first min_tokens tokens' text
                visible = visible[held:]
            seq.text += seq.detok.add(visible)
            if req.params.stop and len(seq.token_ids) > req.params.min_tokens and len(seq.text) > before:
                if self._apply_stop_strings(req, seq, max(before, seq.stop_from)):
                    await _send_quietly(self._scheduler, StopSeq(audit_id=update.audit_id, seq_index=seq.index))
                    return
        if update.finish_reason is not None:
            seq.finish_reason = update.finish_reason
            seq.stop_reason = update.stop_reason

    def _add_logprobs(self, req: _ReqOut, seq: _SeqOut, update) -> None:
        """vLLM's per-position dict: the sampled token (with its rank) first, then the top alternatives ranked 1..k."""
        tokenizer = req.msg.tokenizer
        ranks = update.ranks or [None] * len(update.token_ids)
        for i, (token, lp) in enumerate(zip(update.token_ids, update.logprobs)):
            entry = {token: Logprob(lp, ranks[i], self._decode_one(tokenizer, token))}
            if update.top_logprobs is not None:
                for rank, (alt, alt_lp) in enumerate(update.top_logprobs[i], start=1):
                    if alt not in entry:
                        entry[alt] = Logprob(alt_lp, rank, self._decode_one(tokenizer, alt))
            seq.logprobs.append(entry)

    def _decode_one(self, tokenizer, token: int) -> str | None:
        """A token's text alone (vLLM: tokenizer.decode([id])), cached per tokenizer; None without one."""
        if tokenizer is None:
            return None
        cache = self._decoded.get(tokenizer)
        if cache is None:
            cache = self._decoded[tokenizer] = {}
        text = cache.get(token)
        if text is None:
            text = cache[token] = tokenizer.decode([token])
        return text

    def _apply_stop_strings(self, req: _ReqOut, seq: _SeqOut, before: int) -> bool:
        # vLLM's search: a stop string may start in earlier text but must end in the new text (past `before`)
        best: tuple[int, str] | None = None
        for stop in req.params.stop:
            at = seq.text.find(stop, max(0, before - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        seq.text = seq.text[: at + len(stop)] if req.params.include_stop_str_in_output else seq.text[:at]
        seq.finish_reason = "stop"
        seq.stop_reason = stop
        return True

    def _add_prompt_logprobs(self, req: _ReqOut, packed: list) -> None:
        first_pos, lps, tops, ranks = packed
        prompt = req.msg.prompt_token_ids
        tokenizer = req.msg.tokenizer
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * len(prompt)
        for i, lp in enumerate(lps):
            pos = first_pos + i
            if 0 < pos < len(prompt):
                entry = {
                    prompt[pos]: Logprob(lp, ranks[i] if ranks else None, self._decode_one(tokenizer, prompt[pos]))
                }
                if tops is not None:
                    for rank, (alt, alt_lp) in enumerate(tops[i], start=1):
                        if alt not in entry:
                            entry[alt] = Logprob(alt_lp, rank, self._decode_one(tokenizer, alt))
                req.prompt_logprobs[pos] = entry

    def _snapshot(self, req: _ReqOut, *, final: bool) -> RequestOutput:
        params = req.params
        delta = params.output_kind == RequestOutputKind.DELTA
        lora = req.msg.lora_request
        outputs = []
        for seq in req.seqs:
            if delta and not seq.dirty and not final:
                continue
            visible = len(seq.text)
            if not final and seq.finish_reason is None and req.max_stop_len and not params.include_stop_str_in_output:
                visible = max(
                    seq.sent_chars, len(seq.text) - req.max_stop_len + 1
                )  # a stop string may still be forming
            if delta:
                text, token_ids = seq.text[seq.sent_chars : visible], seq.token_ids[seq.sent_tokens :]
                logprobs = seq.logprobs[seq.sent_tokens :] if seq.logprobs is not None else None
                seq.sent_chars, seq.sent_tokens = visible, len(seq.token_ids)
            else:
                text, token_ids = seq.text[:visible], list(seq.token_ids)
                logprobs = list(seq.logprobs) if seq.logprobs is not None else None
            seq.dirty = False
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    lora_request=lora,
                )
            )
        return RequestOutput(
            request_id=req.msg.caller_request_id or req.msg.audit_id,
            prompt=req.msg.prompt,
            prompt_token_ids=req.msg.prompt_token_ids,
            prompt_logprobs=req.prompt_logprobs,
            outputs=outputs,
            finished=final,
            metrics=msgspec.structs.replace(req.metrics),
            lora_request=lora,
            num_cached_tokens=req.num_cached_tokens,
            audit_id=req.msg.audit_id,
        )

    async def _finish(self, rid: str, req: _ReqOut, now: float) -> None:
        del self._reqs[rid]
        req.metrics.finished_ts = now
        req.final = self._snapshot(req, final=True)
        log = request_logger(self._log, rid, req.metrics.adapter_name)
        reasons = [s.finish_reason for s in req.seqs]
        log.info("request finished", finish_reasons=reasons, tokens=req.metrics.num_generation_tokens)
        if self._audit is None:
            await self._release(req)
            return
        # each completion's text and token ids go to `request_texts` under a salt; its row commits to them
        kept = [salted_text(rid, COMPLETION, s.index, recordable(s.text), s.token_ids) for s in req.seqs]
        committed = [text_commitments(k) for k in kept]
        calls = kept_calls(req.msg.tool_calls, rid, [(s.index, s.text) for s in req.seqs])  # salted apart too
        kept += [row for row, _ in calls.values()]
        records = [
            CompletionRecord(
                request_id=rid,
                index=s.index,
                text="",
                token_ids=[],
                text_commitment=c[0],
                token_ids_commitment=c[1],
                cumulative_logprob=s.cumulative_logprob,
                finish_reason=s.finish_reason or "abort",
                stop_reason=None if s.stop_reason is None else recordable(str(s.stop_reason)),
                adapter_fingerprint=req.msg.adapter_fingerprint,
                prompt_token_count=len(req.msg.prompt_token_ids),
                generated_token_count=len(s.token_ids),
                first_token_at=stored_time(req.metrics.first_token_ts or None),
                finished_at=stored_time(now),
                tool_calls_commitment=calls[s.index][1] if s.index in calls else None,
            )
            for s, c in zip(req.seqs, committed, strict=True)
        ]
        aborted = all(r == "abort" for r in reasons)
        event = EventRecord(
            kind=EventKind.REQUEST_ABORTED if aborted else EventKind.REQUEST_FINISHED,
            at=now,
            request_id=rid,
            # digests and counts only: a payload that grew with n would be read back with every completion
            payload={
                "completions_sha256": completions_digest(records),
                "num_completions": len(records),
                "finish_reason_counts": dict(sorted(Counter(reasons).items())),
                "num_preemptions": req.metrics.num_preemptions,
            },
            dedup_key=f"end:{rid}",
        )
        if self._durable:
            self._held[rid] = req
            await self._audit.send(AuditAppend(completions=records, events=[event], texts=kept, commit_notify=[rid]))
        else:
            await self._audit.send(AuditAppend(completions=records, events=[event], texts=kept))
            await self._release(req)

    async def _release(self, req: _ReqOut) -> None:
        await self._deliver_last(req, req.final)
        await _send_quietly(self._admission, RequestDone(audit_id=req.msg.audit_id))

    async def _deliver(self, req: _ReqOut, item: object) -> None:
        await deliver(req.msg.channel, req.msg.audit_id, item)

    async def _deliver_last(self, req: _ReqOut, item: object) -> None:
        await deliver_last(req.msg.channel, req.msg.audit_id, item)

    async def _refused(self, rid: str, req: _ReqOut, error: object) -> None:
        from loraledger.errors import RequestFailedError

        request_logger(self._log, rid, req.metrics.adapter_name).error("final output not recordable", error=str(error))
        failure = RequestFailedError(
            f"request {rid!r} finished, but the audit store refused its record, so its output is withheld: {error}"
        )
        await self._deliver_last(req, failure)
        await _send_quietly(self._admission, RequestDone(audit_id=rid))

    async def _fail(self, rid: str, error: object) -> None:
        req = self._reqs.pop(rid, None)
        if req is None:
            return
        request_logger(self._log, rid, req.metrics.adapter_name).warning("request failed", error=str(error))
        if self._audit is not None:
            await self._audit.send(
                AuditAppend(
                    events=[
                        EventRecord(
                            kind=EventKind.REQUEST_FAILED,
                            at=time.time(),
                            request_id=rid,
                            payload={"error": f"{type(error).__name__}: {error}"},
                            dedup_key=f"end:{rid}",
                        )
                    ]
                )
            )
        await self._deliver_last(req, error)
        await _send_quietly(self._admission, RequestDone(audit_id=rid))

    async def _fail_pending(self) -> None:
        from loraledger.errors import EngineDeadError

        for rid in list(self._reqs):
            req = self._reqs.pop(rid)
            await self._deliver_last(req, EngineDeadError(f"the engine stopped before request {rid} finished"))
        for rid in list(self._held):
            req = self._held.pop(rid)
            await self._deliver_last(
                req, EngineDeadError(f"the engine stopped before request {rid}'s audit record was committed")
            )


async def _send_quietly(stream, msg) -> None:
    """Notify an actor that may already have stopped (during shutdown); a closed inbox is not an error."""
    try:
        await stream.send(msg)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass
