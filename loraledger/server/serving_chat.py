"""POST /v1/chat/completions: a conversation rendered with the adapter's (or the model's) chat template, as LLM.chat
renders it (loraledger.chat), then one engine request; outputs as a chat completion (JSON or SSE chunks)."""

from __future__ import annotations

import time

import anyio
import msgspec
import structlog
from starlette.responses import Response

from loraledger.chat import render_chat
from loraledger.digests import canonical_json
from loraledger.errors import LoraLedgerError
from loraledger.server.auth import Caller
from loraledger.server.error_responses import APIError, from_engine_error
from loraledger.server.legacy_functions import legacy_answer
from loraledger.server.prompt_logprobs import prompt_logprobs_body
from loraledger.server.protocol import ChatCompletionRequest
from loraledger.server.request_extras import prompt_with_salt, template_kwargs
from loraledger.server.response_nulls import chat_nulls
from loraledger.server.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    RequestContext,
    caller_request_id,
    chat_logprobs,
    check_unicode,
    response_id,
    sse,
    usage,
)
from loraledger.server.streaming import SSEResponse
from loraledger.server.tools.call_stream import tool_delta, tool_stream
from loraledger.server.tools.forced import forced_tools, tool_calls
from loraledger.server.tools.parsers import PARSERS
from loraledger.tool_calls import ToolCallSpec

MAX_TOP_LOGPROBS = 20  # OpenAI's bound


def tool_call_spec(req, forced, parser: str | None) -> ToolCallSpec | None:
    """What the record holds of a request's tools: their definitions, and how each completion's calls are read."""
    if not req.tools:
        return None
    try:
        canonical_json(req.tools)
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"tools must be JSON values with a canonical form ({exc})", param="tools") from None
    parallel = req.parallel_tool_calls is not False
    if forced is not None:
        mode = "named" if forced.name is not None else "required"
        return ToolCallSpec(tools=req.tools, mode=mode, name=forced.name, parallel=parallel)
    if parser is not None:
        return ToolCallSpec(tools=req.tools, mode="auto", parser=parser, parallel=parallel)
    return ToolCallSpec(tools=req.tools, mode="none")


class OpenAIServingChat(OpenAIServing):
    async def render(self, req, lora) -> tuple[dict, str]:
        """The engine prompt ({"prompt_token_ids", "prompt"}) of a conversation, and the template's sha256. Rendering
        and tokenizing run off the event loop: the model's (or adapter's) template in a worker thread, a request's own
        template (only with --trust-request-chat-template) in the sandbox process, under a deadline."""
        kwargs = dict(req.chat_template_kwargs or {}) if isinstance(req.chat_template_kwargs, dict) else None
        own_template = req.chat_template is not None or (kwargs is not None and kwargs.get("chat_template") is not None)
        if own_template and not self.state.config.trust_request_chat_template:
            param = "chat_template" if req.chat_template is not None else "chat_template_kwargs.chat_template"
            raise APIError(
                400, "a chat template in the request is refused: this server renders with the model's or the adapter's "
                "template (start it with --trust-request-chat-template to allow request templates)", param=param,
            )  # fmt: skip
        check_unicode(req.messages, "messages")
        check_unicode(req.tools, "tools")
        check_unicode(req.chat_template_kwargs, "chat_template_kwargs")
        check_unicode(getattr(req, "documents", None), "documents")
        tokenizer = await self.engine.get_lora_tokenizer(lora)
        options = dict(
            chat_template=req.chat_template, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, tools=req.tools,
            chat_template_kwargs=template_kwargs(req), documents=getattr(req, "documents", None),
        )  # fmt: skip
        limits = self.state.limits
        if own_template:
            rendered = await self.state.template_sandbox().render(tokenizer, req.messages, **options)
        else:
            rendered = await anyio.to_thread.run_sync(lambda: render_chat(tokenizer, req.messages, **options))
            if len(rendered.text) > limits.max_rendered_chars:
                raise APIError(
                    400, f"the conversation renders to {len(rendered.text)} characters, over this server's bound of "
                    f"{limits.max_rendered_chars}; send a shorter conversation", param="messages",
                )  # fmt: skip
        ids = rendered.token_ids
        if req.add_special_tokens and tokenizer is not None and getattr(tokenizer, "bos_token_id", None) is not None:
            ids = [tokenizer.bos_token_id, *ids]
        return {"prompt_token_ids": ids, "prompt": rendered.text}, rendered.template_sha256

    async def _create(self, req: ChatCompletionRequest, caller: Caller, ctx: RequestContext, tracker) -> Response:
        forced = forced_tools(req)  # "required" or a named function: enforced through structured outputs
        config = self.state.config
        auto = (
            forced is None and bool(req.tools) and req.tool_choice in (None, "auto") and config.enable_auto_tool_choice
        )
        if forced is None and req.tool_choice == "auto" and req.tools and not auto:
            raise APIError(
                400,
                'tool_choice "auto" needs a server started with --enable-auto-tool-choice --tool-call-parser NAME',
                param="tool_choice",
            )
        if req.echo:
            raise APIError(400, "echo is not supported by this server's chat route", param="echo")
        top = req.top_logprobs
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param="top_logprobs")
        if top and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        lora = await self.models.resolve(req.model, caller, ctx.route)
        stream = bool(req.stream)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(
            req, max_tokens=max_tokens, logprobs=(top or 0) if req.logprobs else None, stream=stream
        )
        if forced is not None:
            params = msgspec.structs.replace(params, structured_outputs=forced.constraint)
        prompt, template_sha = await self.render(req, lora)
        rid = caller_request_id("chatcmpl", ctx)
        structlog.contextvars.bind_contextvars(request_id=rid, adapter=req.model)
        spec = tool_call_spec(req, forced, config.tool_call_parser if auto else None)
        prompt = prompt_with_salt(prompt, req.cache_salt)
        gen = self.outputs(
            rid, prompt, params, lora, caller, ctx, user=req.user, chat_template_sha256=template_sha, tool_calls=spec
        )
        try:
            first = await anext(gen)  # a refusal at admission is a proper HTTP error
        except BaseException:
            with anyio.CancelScope(shield=True):
                await gen.aclose()
            raise
        created = int(time.time())
        tracker.prompt_tokens = len(first.prompt_token_ids or ())
        if stream:
            parser = config.tool_call_parser if auto else None
            parallel = req.parallel_tool_calls is not False
            streams = (lambda: tool_stream(forced, parser, parallel)) if forced is not None or auto else None
            return SSEResponse(lambda emit: self._stream(req, created, gen, first, tracker, emit, streams))
        final = first
        try:
            async for out in gen:
                final = out
        finally:
            with anyio.CancelScope(shield=True):
                await gen.aclose()
        choices, generated = [], 0
        for c in final.outputs:
            generated += len(c.token_ids)
            calls = tool_calls(forced, c.text) if forced is not None else None
            content = c.text
            if auto:
                content, calls = PARSERS[config.tool_call_parser](c.text)
                calls = calls[:1] if req.parallel_tool_calls is False else calls  # as vLLM: the first call kept
            logprobs = (
                {"content": chat_logprobs(c.token_ids, c.logprobs, top or 0, None)}
                if req.logprobs and c.logprobs is not None
                else None
            )
            choices.append({
                "index": c.index,
                "message": {"role": "assistant", "content": content if auto else None if calls else c.text, "refusal": None,
                            "tool_calls": calls or []},
                "logprobs": logprobs,
                "finish_reason": ("stop" if forced is not None and forced.name else "tool_calls") if calls else c.finish_reason,
                "stop_reason": c.stop_reason,
            })  # fmt: skip
        if req.functions is not None:  # asked in the legacy form: answered in it too
            for choice in choices:
                legacy_answer(choice)
        tracker.tokens(generated)
        body = {
            "id": response_id(final),
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "choices": choices,
            "usage": usage(tracker.prompt_tokens, generated),
            "system_fingerprint": self.fingerprint(final),
            "prompt_logprobs": prompt_logprobs_body(final.prompt_logprobs) if req.prompt_logprobs is not None else None,
            "receipts": [final.receipt] if final.receipt is not None else [],  # the log's signed receipt (EVIDENCE.md)
        }
        tracker.finish("ok")
        return Response(msgspec.json.encode(chat_nulls(body)), media_type="application/json")

    async def _stream(self, req, created: int, gen, first, tracker, emit, streams) -> None:
        """streams: with tools forced or auto, a factory of one ToolStream per choice (tool_calls deltas)."""
        rid = response_id(first)
        tools = {i: streams() for i in range(req.n or 1)} if streams is not None else {}
        fingerprint = self.fingerprint(first)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        top = req.top_logprobs or 0
        n = req.n or 1
        reported: set[int] = set()
        generated = 0

        def chunk(choices: list[dict], receipt: dict | None = None) -> bytes:
            body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model, "choices": choices,
                    "system_fingerprint": fingerprint}  # fmt: skip
            if include_usage:
                body["usage"] = None
            if receipt is not None:  # the last chunk carries the request's receipt
                body["receipts"] = [receipt]
            return sse(body)

        outcome = "aborted"
        try:
            try:
                # vLLM's first chunk: the assistant's role, once per choice
                await emit(
                    chunk(
                        [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                            for i in range(n)
                        ]
                    )
                )
                out = first
                while out is not None:
                    choices = []
                    for c in out.outputs:
                        if c.index in reported or (not c.token_ids and not c.text and c.finish_reason is None):
                            continue
                        generated += len(c.token_ids)
                        tracker.tokens(len(c.token_ids))
                        logprobs = (
                            {"content": chat_logprobs(c.token_ids, c.logprobs, top, None)}
                            if req.logprobs and c.logprobs is not None
                            else None
                        )
                        if c.finish_reason is not None:
                            reported.add(c.index)
                        finish = c.finish_reason
                        if c.index in tools:
                            delta, finish = tool_delta(tools[c.index], c.text, finish)
                            if not delta and logprobs is None and finish is None:
                                continue  # text held back: it may begin a call
                        else:
                            delta = {"content": c.text} if c.text or finish is None else {}
                        choices.append({"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                                        "stop_reason": c.stop_reason})  # fmt: skip
                    last = out.receipt if out.finished else None
                    if choices or last is not None:
                        await emit(chunk(choices, last))
                    if out.finished:
                        break
                    out = await anext(gen, None)
                if include_usage:
                    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model, "choices": [],
                            "system_fingerprint": fingerprint, "usage": usage(tracker.prompt_tokens, generated)}  # fmt: skip
                    await emit(sse(body))
                outcome = "ok"
            except LoraLedgerError as exc:
                error = from_engine_error(exc)
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
        finally:
            with anyio.CancelScope(shield=True):
                await gen.aclose()
            tracker.finish(outcome)
        await emit(SSE_DONE)
