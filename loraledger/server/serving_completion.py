"""POST /v1/completions: prompts in OpenAI's four forms to engine requests, outputs to completions (JSON or SSE)."""

from __future__ import annotations

import time

import anyio
import msgspec
import structlog
from starlette.responses import Response

from loraledger.errors import LoraLedgerError
from loraledger.server.auth import Caller
from loraledger.server.error_responses import APIError, from_engine_error
from loraledger.server.prompt_logprobs import (
    echo_logprobs,
    echo_only,
    joined,
    prompt_logprobs_body,
    prompt_logprobs_wanted,
)
from loraledger.server.protocol import CompletionRequest
from loraledger.server.request_extras import prompt_with_salt
from loraledger.server.response_nulls import completion_nulls
from loraledger.server.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    RequestContext,
    caller_request_id,
    completion_logprobs,
    response_id,
    sse,
    usage,
)
from loraledger.server.streaming import SSEResponse


class OpenAIServingCompletion(OpenAIServing):
    async def _create(self, req: CompletionRequest, caller: Caller, ctx: RequestContext, tracker) -> Response:
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        n = req.n if req.n is not None else 1
        if req.best_of is not None and req.best_of != n:
            raise APIError(400, "best_of is not supported (it must equal n, or be left out)", param="best_of")
        lora = await self.models.resolve(req.model, caller, ctx.route)
        stream = bool(req.stream)
        max_tokens = 1 if echo_only(req) else req.max_tokens  # the one token run for echo alone is dropped
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, stream=stream)
        if prompt_logprobs_wanted(req) is not None:
            params = msgspec.structs.replace(params, prompt_logprobs=prompt_logprobs_wanted(req))
        prompts = [prompt_with_salt(p, req.cache_salt) for p in await self._prompts(req, lora)]
        base = caller_request_id("cmpl", ctx)
        ids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
        structlog.contextvars.bind_contextvars(request_id=base, adapter=req.model)
        echo = await self._echo_texts(req, prompts, lora) if req.echo else None
        gens = [
            self.outputs(rid, prompt, params, lora, caller, ctx, user=req.user) for rid, prompt in zip(ids, prompts)
        ]
        try:
            # each request's first output is awaited before answering (a refusal at admission is a proper HTTP error),
            # all of them at once: the prompts run together, as vLLM runs them
            firsts = await self._first_outputs(gens)
        except BaseException:
            for gen in gens:
                with anyio.CancelScope(shield=True):
                    await gen.aclose()
            raise
        created = int(time.time())
        tokenizer = None
        if req.echo and req.logprobs is not None:
            tokenizer = await self.engine.get_lora_tokenizer(lora)
        if stream:
            return SSEResponse(
                lambda emit: self._stream(req, base, created, gens, firsts, echo, tracker, emit, tokenizer)
            )
        finals = await self._finals(gens, firsts)
        body = self._response(
            req, base if len(finals) > 1 else response_id(finals[0]), created, finals, echo, tracker, tokenizer
        )
        tracker.finish("ok")
        return Response(msgspec.json.encode(completion_nulls(body)), media_type="application/json")

    async def _prompts(self, req: CompletionRequest, lora) -> list[object]:
        """The engine prompts of a body's `prompt`: a str, a list of str, a list of token ids, or a list of those."""
        p = req.prompt
        if isinstance(p, str):
            texts, ids = [p], None
        elif p and all(isinstance(x, str) for x in p):
            texts, ids = list(p), None
        elif p and all(isinstance(x, int) for x in p):
            texts, ids = None, [list(p)]
        elif p and all(isinstance(x, list) for x in p):
            texts, ids = None, [list(x) for x in p]
        else:
            raise APIError(
                400,
                "prompt must be a string, a list of strings, a list of token ids or a list of such lists, and not empty",
                param="prompt",
            )
        count = len(texts if texts is not None else ids)
        limit = self.state.config.max_prompts_per_request
        if count > limit:
            raise APIError(400, f"{count} prompts in one request; at most {limit}", param="prompt")
        if ids is not None:
            return [{"prompt_token_ids": x} for x in ids]
        if req.add_special_tokens is False:
            tokenizer = await self.engine.get_lora_tokenizer(lora)
            if tokenizer is None:
                raise APIError(
                    400, "add_special_tokens=false needs a tokenizer; send token ids", param="add_special_tokens"
                )
            return [{"prompt_token_ids": tokenizer.encode(t, add_special_tokens=False), "prompt": t} for t in texts]
        return texts

    async def _echo_texts(self, req, prompts, lora) -> list[str]:
        tokenizer = None
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(p)
            elif p.get("prompt") is not None:
                out.append(p["prompt"])
            else:
                if tokenizer is None:
                    tokenizer = await self.engine.get_lora_tokenizer(lora)
                if tokenizer is None:
                    raise APIError(400, "echo of token ids needs a tokenizer", param="echo")
                ids = p["prompt_token_ids"]
                vocab = self.engine.model_config.vocab_size
                bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
                if bad:
                    raise APIError(
                        400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt"
                    )
                out.append(await anyio.to_thread.run_sync(tokenizer.decode, ids))
        return out

    async def _first_outputs(self, gens) -> list:
        firsts: list = [None] * len(gens)
        errors: list[Exception] = []

        async def first(i: int) -> None:
            try:
                firsts[i] = await anext(gens[i])
            except Exception as exc:  # raised below as itself, not in an ExceptionGroup; the other prompts stop
                errors.append(exc)
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            for i in range(len(gens)):
                tg.start_soon(first, i)
        if errors:
            raise errors[0]
        return firsts

    async def _finals(self, gens, firsts) -> list:
        finals: list = list(firsts)
        errors: list[Exception] = []

        async def drain(i: int) -> None:
            try:
                async for out in gens[i]:
                    finals[i] = out
            except Exception as exc:  # raised below as itself, not in an ExceptionGroup; the other prompts stop
                errors.append(exc)
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            for i, first in enumerate(firsts):
                if not first.finished:
                    tg.start_soon(drain, i)
        if errors:
            with anyio.CancelScope(shield=True):
                for gen in gens:
                    await gen.aclose()
            raise errors[0]
        return finals

    def _response(self, req, rid: str, created: int, finals, echo, tracker, tokenizer=None) -> dict:
        choices, prompt_tokens, generated = [], 0, 0
        n = req.n or 1
        fingerprint = self.fingerprint(finals[0])
        for p, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids or ())
            alone = echo_only(req)
            for c in out.outputs:
                generated += 0 if alone else len(c.token_ids)
                logprobs = None
                if req.logprobs is not None and c.logprobs is not None and not alone:
                    logprobs, _ = completion_logprobs(c.token_ids, c.logprobs, len(echo[p]) if echo else 0, None)
                if echo and req.logprobs is not None:
                    prompt = echo_logprobs(out.prompt_token_ids or [], out.prompt_logprobs, req.logprobs, tokenizer)
                    logprobs = joined(prompt, logprobs)
                choices.append({
                    "index": p * n + c.index,
                    "text": (echo[p] if echo else "") + ("" if alone else c.text),
                    "logprobs": logprobs,
                    "finish_reason": "length" if alone else c.finish_reason,
                    "stop_reason": None if alone else c.stop_reason,
                    "prompt_logprobs": prompt_logprobs_body(out.prompt_logprobs) if req.prompt_logprobs is not None else None,
                })  # fmt: skip
        tracker.prompt_tokens = prompt_tokens
        tracker.tokens(generated)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": req.model,
            "choices": choices,
            "usage": usage(prompt_tokens, generated),
            "system_fingerprint": fingerprint,
            "receipts": [out.receipt for out in finals if out.receipt is not None],  # one per prompt (EVIDENCE.md)
        }

    async def _stream(self, req, base: str, created: int, gens, firsts, echo, tracker, emit, tokenizer=None) -> None:
        n = req.n or 1
        rid = base if len(gens) > 1 else response_id(firsts[0])
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        fingerprint = self.fingerprint(firsts[0])
        offsets: dict[int, int] = {}
        reported: set[int] = set()  # choices whose finish_reason was sent
        counts = {"prompt": sum(len(f.prompt_token_ids or ()) for f in firsts), "generated": 0}
        tracker.prompt_tokens = counts["prompt"]

        def chunk(choices: list[dict]) -> dict:
            body = {"id": rid, "object": "text_completion", "created": created, "model": req.model, "choices": choices,
                    "system_fingerprint": fingerprint}  # fmt: skip
            if include_usage:
                body["usage"] = None
            return body

        errors: list[Exception] = []

        async def one(p: int) -> None:
            try:
                await each(p)
            except LoraLedgerError as exc:  # reported in the stream below; the other prompts stop
                errors.append(exc)
                tg.cancel_scope.cancel()

        alone = echo_only(req)  # the prompt alone: its chunk is the choice's only one

        async def each(p: int) -> None:
            out = firsts[p]
            if echo:
                prompt = None
                if req.logprobs is not None:  # the prompt's logprobs, as the unstreamed answer's first part
                    prompt = echo_logprobs(out.prompt_token_ids or [], out.prompt_logprobs, req.logprobs, tokenizer)
                for i in range(n):
                    offsets[p * n + i] = len(echo[p])
                choices = [{"index": p * n + i, "text": echo[p], "logprobs": prompt, "finish_reason": "length" if alone else None}
                           for i in range(n)]  # fmt: skip
                if alone:
                    reported.update(p * n + i for i in range(n))
                    for c in choices:
                        c["stop_reason"] = None
                await emit(sse(chunk(choices)))
            while True:
                choices = []
                for c in out.outputs:
                    index = p * n + c.index
                    if index in reported or (not c.token_ids and not c.text and c.finish_reason is None):
                        continue
                    counts["generated"] += len(c.token_ids)
                    tracker.tokens(len(c.token_ids))
                    logprobs = None
                    if req.logprobs is not None and c.logprobs is not None:
                        logprobs, offsets[index] = completion_logprobs(
                            c.token_ids, c.logprobs, offsets.get(index, 0), None
                        )
                    if c.finish_reason is not None:
                        reported.add(index)
                    choices.append({"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                                    "stop_reason": c.stop_reason})  # fmt: skip
                if choices or (out.finished and out.receipt is not None):
                    body = chunk(choices)
                    if out.finished and out.receipt is not None:  # the prompt's last chunk carries its receipt
                        body["receipts"] = [out.receipt]
                    await emit(sse(body))
                if out.finished:
                    return
                out = await anext(gens[p], None)
                if out is None:
                    return

        outcome = "aborted"
        try:
            async with anyio.create_task_group() as tg:
                for p in range(len(gens)):
                    tg.start_soon(one, p)
            if errors:
                error = from_engine_error(errors[0])
                outcome = "rejected" if error.status < 500 else "failed"
                await emit(
                    sse(
                        {
                            "error": {
                                "message": error.message,
                                "type": error.type,
                                "param": error.param,
                                "code": error.code,
                            }
                        }
                    )
                )
            else:
                if include_usage:
                    body = chunk([])
                    body["usage"] = usage(counts["prompt"], counts["generated"])
                    await emit(sse(body))
                outcome = "ok"
        finally:
            with anyio.CancelScope(shield=True):
                for gen in gens:
                    await gen.aclose()
            tracker.finish(outcome)
        await emit(SSE_DONE)
