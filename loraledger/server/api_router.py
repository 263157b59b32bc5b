"""The routes: each a few lines handing the body, the caller (one Depends) and the request's context to a serving class."""

from __future__ import annotations

import msgspec
import structlog
from fastapi import APIRouter, Depends, Request
from starlette.responses import PlainTextResponse, Response

from loraledger.errors import AdapterError, AdapterNotFoundError
from loraledger.server.auth import Caller, authenticate, require_admin
from loraledger.server.error_responses import error_response, from_engine_error
from loraledger.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoRAAdapterRequest,
)
from loraledger.server.request_extras import WARNING_HEADER, caller_id, ignored_warning
from loraledger.server.responses_protocol import ResponsesRequest
from loraledger.server.serving_engine import RequestContext
from loraledger.server.streaming import until_disconnect
from loraledger.version import __version__

router = APIRouter()


def _state(request: Request):
    return request.app.state.server


def _context(request: Request, body=None) -> RequestContext:
    trace = {name: request.headers[name][:512] for name in ("traceparent", "tracestate") if name in request.headers}
    rid = caller_id(structlog.contextvars.get_contextvars().get("caller_request_id"), body)
    structlog.contextvars.bind_contextvars(caller_request_id=rid)
    return RequestContext(route=request.url.path, caller_request_id=rid, trace_headers=trace or None)


def _json(body: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


async def _generate(request: Request, work, body=None) -> Response:
    """A generation route's response; a client gone before it is ready aborts its requests (on record as aborted).
    The body's ignored fields are named in its Warning header."""
    finished, response = await until_disconnect(request.receive, work)
    if not finished:
        return Response(status_code=499)
    warning = ignored_warning(body)
    if warning is not None:
        response.headers[WARNING_HEADER] = warning
    return response


@router.post("/v1/completions")
async def create_completion(
    body: CompletionRequest, request: Request, caller: Caller = Depends(authenticate)
) -> Response:
    ctx = _context(request, body)
    return await _generate(request, lambda: _state(request).completion.create(body, caller, ctx), body)


@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, caller: Caller = Depends(authenticate)
) -> Response:
    ctx = _context(request, body)
    return await _generate(request, lambda: _state(request).chat.create(body, caller, ctx), body)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, caller: Caller = Depends(authenticate)) -> Response:
    return await _generate(request, lambda: _state(request).responses.create(body, caller, _context(request)))


@router.get("/v1/models")
async def list_models(request: Request, caller: Caller = Depends(authenticate)) -> Response:
    return _json({"object": "list", "data": _state(request).models.cards(caller)})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request, caller: Caller = Depends(authenticate)) -> Response:
    """OpenAI's models.retrieve: one card, key-filtered as the list is (a name the key may not use is not found)."""
    return _json(_state(request).models.card(model_id, caller))


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(
    body: LoadLoRAAdapterRequest, request: Request, caller: Caller = Depends(require_admin)
) -> Response:
    try:
        await _state(request).models.load(body.lora_name, body.lora_path, body.load_inplace)
    except AdapterError as exc:  # about the body's lora_path; a folder that is not there is a 404, as in vLLM
        error = from_engine_error(exc)
        error.param = "lora_path"
        if isinstance(exc, AdapterNotFoundError):
            error.status = 404
        raise error from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, request: Request, caller: Caller = Depends(require_admin)
) -> Response:
    await _state(request).models.unload(body.lora_name, body.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@router.post("/tokenize")
async def tokenize(
    body: TokenizeChatRequest | TokenizeCompletionRequest, request: Request, caller: Caller = Depends(authenticate)
) -> Response:
    return _json(await _state(request).tokenization.tokenize(body, caller, request.url.path))


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request, caller: Caller = Depends(authenticate)) -> Response:
    return _json(await _state(request).tokenization.detokenize(body, caller, request.url.path))


@router.get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
    if state.draining or state.engine_dead():
        return Response(status_code=503, headers={"Retry-After": "1"})
    return Response(status_code=200)


@router.get("/ready")
async def ready(request: Request) -> Response:
    """Readiness (a Kubernetes readinessProbe): 200 while this server can serve, 503 with the reason otherwise;
    /health is liveness (the process and its engine are alive)."""
    reason = await _state(request).not_ready()
    if reason is not None:
        return error_response(503, reason, type="service_unavailable", code="not_ready", headers={"Retry-After": "1"})
    return Response(status_code=200)


@router.get("/version")
async def version() -> Response:
    return _json({"version": __version__})


@router.get("/metrics")
async def metrics(request: Request, caller: Caller = Depends(authenticate)) -> Response:
    """Prometheus' text format; with keys configured, for a caller with any valid key (a scraper gets its own)."""
    return await _state(request).render_metrics()
