"""What every generation route shares: request ids, the response id, SamplingParams from a request body, running a
request on the engine (aborted, and on record as aborted, when its client goes away), logprobs, per-request metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec
import structlog

from loraledger.audit_ids import new_audit_id
from loraledger.engine_client import EngineClient
from loraledger.errors import SamplingParamsError
from loraledger.lora.request import LoRARequest
from loraledger.outputs import Logprob, RequestOutput
from loraledger.sampling_params import RequestOutputKind, SamplingParams
from loraledger.server.auth import Caller
from loraledger.server.error_responses import APIError
from loraledger.server.limits import check_sampling_lists
from loraledger.server.structured_outputs import structured_outputs_for

LOGPROB_FLOOR = -9999.0  # vLLM's stand-in for -inf in JSON


def caller_request_id(prefix: str, ctx: RequestContext) -> str:
    """The request id the engine gets as the caller's (vLLM's): the client's X-Request-Id, else `prefix-` and a new
    UUIDv7. It is on record beside the request's audit key (requests.caller_request_id); two unfinished requests
    cannot share one (a repeated X-Request-Id while the first runs is refused), a finished one's may be reused."""
    return ctx.caller_request_id if ctx.caller_request_id is not None else f"{prefix}-{new_audit_id()}"


def response_id(output: RequestOutput) -> str:
    """A response's `id`: the audit key of the request that produced it (RequestOutput.audit_id; `loraledger audit show
    ID` shows its record). This function is the one place that choice is made. (A /v1/completions body with several
    prompts runs one request per prompt, whose caller ids are `ID-0`, `ID-1`, ...; its response's id is `ID`, and
    `audit show ID-0` finds the first.)"""
    return output.audit_id or output.request_id


@dataclass
class RequestContext:
    """What the server knows about one HTTP request beyond its body."""

    route: str
    caller_request_id: str | None = (
        None  # the client's X-Request-Id: echoed back, and the request's caller id on record
    )
    received: float = field(default_factory=time.perf_counter)
    trace_headers: dict[str, str] | None = None  # the caller's W3C traceparent / tracestate, for the request's span


class Tracker:
    """One HTTP request's metrics: outcome, tokens, time to first token and end to end, labelled by adapter (model)."""

    def __init__(self, metrics, adapter: str, ctx: RequestContext) -> None:
        self.metrics, self.adapter, self.ctx = metrics, adapter, ctx
        self.first_token: float | None = None
        self.prompt_tokens = 0
        self.generated = 0
        self.done = False

    def tokens(self, n: int) -> None:
        if n and self.first_token is None:
            self.first_token = time.perf_counter()
            self.metrics.ttft.labels(adapter=self.adapter).observe(self.first_token - self.ctx.received)
        self.generated += n

    def finish(self, outcome: str) -> None:
        if self.done:
            return
        self.done = True
        m = self.metrics
        m.requests.labels(adapter=self.adapter, outcome=outcome).inc()
        m.prompt_tokens.labels(adapter=self.adapter).inc(self.prompt_tokens)
        m.generation_tokens.labels(adapter=self.adapter).inc(self.generated)
        m.e2e.labels(adapter=self.adapter).observe(time.perf_counter() - self.ctx.received)


def outcome_of(exc: BaseException | None, outputs_aborted: bool = False) -> str:
    if exc is None:
        return "aborted" if outputs_aborted else "ok"
    status = getattr(exc, "status", None)
    if status is None:
        from loraledger.errors import LoraLedgerError
        from loraledger.server.error_responses import from_engine_error

        status = from_engine_error(exc).status if isinstance(exc, LoraLedgerError) else 500
    return "rejected" if status < 500 else "failed"


def check_unicode(value: object, param: str) -> None:
    """400 for text holding a lone surrogate (JSON can carry "\\ud800"; no tokenizer can encode it), anywhere in a
    str or in the strs of nested lists and dicts (a body's: bounded by the body size limit)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise APIError(400, f"{param} is not valid Unicode text ({exc.reason})", param=param) from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


# body field -> SamplingParams field, where the two names agree on the meaning
_SAME = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_tokens", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "stop_token_ids", "truncate_prompt_tokens", "allowed_token_ids", "bad_words", "prompt_logprobs",
)  # fmt: skip


class OpenAIServing:
    """Base of the serving classes: the engine, the models, and the request-to-engine plumbing they share."""

    def __init__(self, state) -> None:
        self.state = state
        self._defaults: dict | None = None
        self._log = structlog.get_logger().bind(actor="server")

    @property
    def engine(self) -> EngineClient:
        return self.state.engine

    @property
    def models(self):
        return self.state.models

    def defaults(self) -> dict:
        """The model's generation_config.json defaults that differ from SamplingParams' (vLLM's serve applies them
        to every field a request leaves out)."""
        if self._defaults is None:
            plain = msgspec.structs.asdict(SamplingParams())
            model = msgspec.structs.asdict(self.engine.get_default_sampling_params())
            self._defaults = {k: v for k, v in model.items() if v != plain.get(k)}
        return self._defaults

    def sampling_params(self, req, *, max_tokens: int | None, logprobs: int | None, stream: bool) -> SamplingParams:
        """SamplingParams for a request body: its fields over the model's defaults. SamplingParamsError (400) names
        a bad value as SamplingParams' field; what this server does not do is refused with a 400 here."""
        check_sampling_lists(req, self.state.limits)
        if req.use_beam_search:
            raise APIError(400, "use_beam_search is not supported by this server", param="use_beam_search")
        if req.priority not in (None, 0):
            raise APIError(
                400, "priority scheduling is not supported by this server; leave priority at 0", param="priority"
            )
        fields = dict(self.defaults())
        for name in _SAME:
            value = getattr(req, name)
            if value is not None:
                fields[name] = value
        if req.stop is not None:
            fields["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if req.logit_bias is not None:
            fields["logit_bias"] = dict(req.logit_bias)  # str keys: SamplingParams takes JSON's token ids
        if max_tokens is not None or "max_tokens" not in fields:
            fields["max_tokens"] = max_tokens
        if logprobs is not None:
            fields["logprobs"] = logprobs
        if req.vllm_xargs is not None:
            fields["extra_args"] = req.vllm_xargs
        fields["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        fields["structured_outputs"] = structured_outputs_for(req)
        try:
            return SamplingParams(**fields)
        except TypeError as exc:  # a value of a type SamplingParams cannot even compare
            raise SamplingParamsError(f"a sampling value has the wrong type: {exc}") from None

    def fingerprint(self, output: RequestOutput) -> str:
        """system_fingerprint: the adapter's content fingerprint, or the base model's for base requests."""
        metrics = output.metrics
        fp = metrics.adapter_fingerprint if metrics is not None else None
        return fp or self.engine.base_model_fingerprint

    def tracker(self, model: str, ctx: RequestContext) -> Tracker:
        return Tracker(self.state.metrics, self.models.label(model), ctx)

    async def create(self, req, caller: Caller, ctx: RequestContext):
        """Serve one generation request (the subclass's `_create`); its metrics record how it ended, whatever ends it."""
        tracker = self.tracker(req.model, ctx)
        try:
            return await self._create(req, caller, ctx, tracker)
        except BaseException as exc:
            tracker.finish(outcome_of(exc) if isinstance(exc, Exception) else "aborted")
            raise

    async def outputs(
        self,
        request_id: str,
        prompt: object,
        params: SamplingParams,
        lora: LoRARequest | None,
        caller: Caller,
        ctx: RequestContext,
        *,
        user: str | None = None,
        chat_template_sha256: str | None = None,
        tool_calls: object = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs from the engine. Leaving early (the client went away; the server shutting down past
        its grace period) aborts the request, and returns once what it generated is on record as aborted."""
        hold = self.models.hold(lora)  # until the engine admitted it: an unload waits for that
        gen = self.engine.generate(
            prompt, params, request_id, lora,
            tenant=caller.tenant, key_id=caller.key_id, user=user,
            chat_template_sha256=chat_template_sha256, **({"tool_calls": tool_calls} if tool_calls is not None else {}),
        )  # fmt: skip
        started = time.time_ns()
        try:
            async with aclosing(gen) as stream:
                async for out in stream:
                    hold.release()  # admitted: its binding to the adapter is on record
                    if out.finished:  # one span per request, linked to the caller's trace (loraledger/evidence/otel.py)
                        operation = "chat" if "chat" in ctx.route else "text_completion"
                        model = lora.lora_name if lora is not None else self.state.config.model_name
                        self.state.tracing.record(out, operation=operation, model=model, start_ns=started,
                                                  headers=ctx.trace_headers, caller=caller)  # fmt: skip
                    yield out
        finally:
            hold.release()


# --- logprobs in OpenAI's two shapes ----------------------------------------------------------------


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _token_text(entry: Logprob | None, token_id: int, tokenizer) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    if tokenizer is not None:
        return tokenizer.decode([token_id])
    return f"token_id:{token_id}"


def _ranked(entries: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(entries.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))


def completion_logprobs(token_ids, logprobs, offset: int, tokenizer) -> tuple[dict, int]:
    """The completions API's logprobs object for these tokens, text offsets from `offset`; returns it and the next offset."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entries in zip(token_ids, logprobs or []):
        chosen = entries.get(token_id)
        text = _token_text(chosen, token_id, tokenizer)
        tokens.append(text)
        token_logprobs.append(_lp(chosen.logprob) if chosen is not None else None)
        top.append({_token_text(lp, tid, tokenizer): _lp(lp.logprob) for tid, lp in _ranked(entries)})
        offsets.append(offset)
        offset += len(text)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}, offset


def chat_logprobs(token_ids, logprobs, k: int, tokenizer) -> list[dict]:
    """The chat API's logprobs.content entries for these tokens, each with its top `k` alternatives."""
    content = []
    for token_id, entries in zip(token_ids, logprobs or []):
        chosen = entries.get(token_id)
        text = _token_text(chosen, token_id, tokenizer)
        alternatives = [(tid, lp) for tid, lp in _ranked(entries) if lp.rank is not None and lp.rank <= k][:k]
        content.append({
            "token": text,
            "logprob": _lp(chosen.logprob) if chosen is not None else LOGPROB_FLOOR,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := _token_text(lp, tid, tokenizer)), "logprob": _lp(lp.logprob), "bytes": list(t.encode("utf-8"))}
                for tid, lp in alternatives
            ],
        })  # fmt: skip
    return content


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


_encode = msgspec.json.Encoder().encode


# characters JSON leaves as they are and some line readers split on (str.splitlines: NEL, LINE / PARAGRAPH SEPARATOR)
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), ("\u2028".encode(), b"\\u2028"), ("\u2029".encode(), b"\\u2029"))


def sse(payload: dict) -> bytes:
    """One server-sent event: the payload as one line of JSON (no byte in it that any line reader breaks on)."""
    data = _encode(payload)
    if b"\xc2\x85" in data or b"\xe2\x80\xa8" in data or b"\xe2\x80\xa9" in data:
        for raw, escaped in _LINE_BREAKS:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
