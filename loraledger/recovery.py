"""Crash recovery: the unfinished requests of engine instances that are gone are put on record as interrupted, and optionally re-run.

Several engines may share one audit database. At start, and then every third of its lease while it
runs, an engine claims the instances whose lease has expired (or whose process is certainly gone,
store/process_identity.py) and records their unfinished requests as interrupted, in one transaction
under the writers' lock, so two engines never both claim one (store.recover_expired). A live peer's
requests are never touched. With resume_interrupted the claimer re-runs them under their original
bindings, whichever instance admitted them. At start it also takes the unfinished requests of a log
written before instances existed (revision 0007).
"""

from __future__ import annotations

import functools
import json
import secrets
from typing import TYPE_CHECKING

import anyio
import msgspec

from loraledger.errors import AuditUnavailableError, InstanceLeaseLostError, LoraLedgerError, RequestErasedError
from loraledger.logging import get_logger
from loraledger.lora.request import LoRARequest
from loraledger.sampling_params import SamplingParams
from loraledger.structured_outputs import from_canonical
from loraledger.tool_calls import ToolCallSpec, spec_from_record

if TYPE_CHECKING:
    from loraledger.engine_client import EngineClient

log = get_logger("recovery")


class Recovery:
    """One engine's recovery of the instances that are gone: at its start, then every third of its lease while it runs
    (a replacement started before its predecessor's lease ran out takes over its requests once it has)."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self.interrupted: list[str] = []  # audit keys of the requests this engine recorded as interrupted
        self.resumed: dict[str, object] = {}  # with resume_interrupted: audit key -> final RequestOutput or error
        self._resumes: list[anyio.Event] = []  # one per recovery that found requests: set once their outcomes are in
        self._tg = None

    async def start(self, tg) -> None:
        """Recover at start; then watch for peers whose lease expires, in a task of `tg` (the engine's)."""
        self._tg = tg
        self._found(await record_interrupted(self.engine))
        tg.start_soon(self._watch_peers)

    def _found(self, unfinished: list) -> None:
        self.interrupted += [r.request_id for r in unfinished]
        if unfinished and self.engine.args.resume_interrupted:
            done = anyio.Event()
            self._resumes.append(done)
            self._tg.start_soon(resume, self.engine, unfinished, self.resumed, done)

    async def _watch_peers(self) -> None:
        while True:
            await anyio.sleep(self.engine.args.audit_lease_seconds / 3)
            try:
                self._found(await record_interrupted(self.engine, at_start=False))
            except InstanceLeaseLostError:
                return  # this engine's own lease is gone: its LeaseKeeper stops it
            except AuditUnavailableError as exc:
                log.warning("could not look for expired peer instances; trying again", error=str(exc))

    async def wait(self) -> dict[str, object]:
        """Wait until every resumed request (so far) has its outcome (final RequestOutput or error) in `resumed`."""
        for done in list(self._resumes):
            await done.wait()
        return self.resumed


async def record_interrupted(engine: EngineClient, *, at_start: bool = True) -> list:
    """Claim the instances that are gone and record their unfinished requests as interrupted; returns those requests."""
    store = engine.store
    recover = functools.partial(store.recover_expired, resume=engine.args.resume_interrupted, at_start=at_start)
    recovery = await anyio.to_thread.run_sync(recover)
    if recovery.instances or recovery.requests:
        log.warning(
            "recovered engine instances that are gone",
            instances=recovery.instances,
            interrupted=len(recovery.requests),
            resume=engine.args.resume_interrupted,
        )
    return recovery.requests


async def resume(engine: EngineClient, unfinished: list, results: dict, done: anyio.Event) -> None:
    """Re-run interrupted requests under their original binding; each outcome (final output or error) lands in `results`,
    keyed by the request's audit key (RequestOutput.audit_id; its request_id is the caller's id, as first submitted)."""
    from loraledger.store import texts  # SQLAlchemy: only an engine with an audit store resumes anything

    store = engine.store
    payloads = await anyio.to_thread.run_sync(store.admitted_payloads, [r.request_id for r in unfinished])
    # from revision 0013 the prompt's token ids are kept in `request_texts`, not in the event (so they can be erased),
    # and from 0016 its tools and constraint text too
    kept, erased = await anyio.to_thread.run_sync(texts.kept_for_resume, store, [r.request_id for r in unfinished])

    async def one(record) -> None:
        rid = record.request_id
        try:
            await run(record)
        except Exception as exc:  # one request that cannot be resumed is that request's outcome, not the engine's
            results[rid] = (
                exc
                if isinstance(exc, LoraLedgerError)
                else LoraLedgerError(f"request {rid!r} cannot be resumed: {type(exc).__name__}: {exc}")
            )

    async def run(record) -> None:
        rid = record.request_id
        if rid in erased:  # an erased request gets no new text: it is not resumed (the erasure says why)
            results[rid] = RequestErasedError(
                f"request {rid!r} was interrupted and then erased (event {erased[rid]}): it is not resumed, since it "
                "would keep new text after its erasure; submit it again as a new request if it must run"
            )
            return
        payload = payloads.get(rid) or {}
        prompt_row = kept.get((rid, texts.PROMPT, 0))
        prompt_ids = payload.get("prompt_token_ids", None if prompt_row is None else list(prompt_row.token_ids))
        if prompt_ids is None:
            results[rid] = LoraLedgerError(
                f"request {rid!r} cannot be resumed: its prompt was not kept (audit_prompts != 'text')"
            )
            return
        lora = None
        if record.lora_int_id is not None:
            lora = LoRARequest(record.lora_name, record.lora_int_id, record.lora_path)
        params = msgspec.convert(
            record.sampling_params, SamplingParams, str_keys=True
        )  # logit_bias keys come back as JSON str
        if record.constraint_kind is not None:
            constraint = _kept(kept, rid, texts.CONSTRAINT, record.constraint_text)
            if constraint is None:
                results[rid] = LoraLedgerError(
                    f"request {rid!r} cannot be resumed: its constraint's text was not kept (audit_prompts != 'text')"
                )
                return
            params = msgspec.structs.replace(params, structured_outputs=from_canonical(constraint))
        tool_calls, note = _tool_calls(record, _kept(kept, rid, texts.TOOLS, record.tools_text))
        channel = await engine.submit(
            record.caller_request_id or rid,  # a binding from before revision 0006: its key was the caller's id
            {"prompt_token_ids": prompt_ids, "cache_salt": _private_salt(rid)},
            params,
            lora,
            tenant=record.tenant,
            resume=True,
            bound_fingerprint=record.adapter_fingerprint,
            audit_id=rid,  # it runs under the binding on record, keyed as it was
            bound_commit=record.adapter_commit_sha,  # a Hub adapter: the commit it ran on, though its branch moved
            tool_calls=tool_calls,  # its calls are read as the first run read them
            resume_note=note,  # or the request_resumed event says why they cannot be
        )
        async with channel:
            async for delivery in channel:
                if isinstance(delivery.item, BaseException) or delivery.item.finished:
                    results[rid] = delivery.item
                    return

    try:
        async with anyio.create_task_group() as tg:
            for record in unfinished:
                tg.start_soon(one, record)
    finally:
        done.set()


def _private_salt(rid: str) -> str:
    """A resumed request's prefix-cache salt, its own and no one else's: the caller's cache_salt is not on record, so
    the request may have had one, and its KV blocks must not answer (or be answered by) another request's prefix."""
    return f"resumed {rid} {secrets.token_hex(16)}"


def _kept(kept: dict, rid: str, part: str, inline: str | None) -> str | None:
    """A binding's text kept apart (revision 0016 on), or the one it holds inline (before), or None."""
    row = kept.get((rid, part, 0))
    return inline if row is None else row.text


def _tool_calls(record, tools_text: str | None) -> tuple[ToolCallSpec | None, str | None]:
    """How a resumed request's completions read their tool calls, as its binding says: (the spec, None), or (None,
    why not) for a request with tools whose binding does not say how, or whose tools were not kept."""
    if record.tools_sha256 is None:
        return None, None
    if record.tool_reading is None:
        return None, "the binding does not say how its calls are read (written before revision 0016)"
    if tools_text is None:
        return None, "its tool definitions were not kept (audit_prompts != 'text')"
    try:
        return spec_from_record(json.loads(tools_text), record.tool_reading), None
    except (ValueError, TypeError, msgspec.ValidationError) as exc:
        return None, f"its tools and tool_reading do not make a reading: {exc}"
