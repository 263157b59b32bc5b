"""OpenAI error objects: the server's own refusals (APIError) and the engine's typed errors mapped to HTTP statuses."""

from __future__ import annotations

import msgspec
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from loraledger import errors as e
from loraledger.sources import (
    HubAccessError,
    HubNotFoundError,
    HubOfflineError,
    HubTimeoutError,
    HubTooLargeError,
    HubUnavailableError,
)

RETRY_AFTER_S = 1  # what a 503 for a transient cause (audit store down, over capacity) tells clients to wait


class APIError(Exception):
    """A refusal with its HTTP status, as an OpenAI error object: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = dict(headers or {})

    def response(self) -> Response:
        return error_response(
            self.status, self.message, type=self.type, code=self.code, param=self.param, headers=self.headers
        )


def error_response(status: int, message: str, *, type: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:  # fmt: skip
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return Response(msgspec.json.encode(body), status_code=status, headers=headers, media_type="application/json")


def unavailable(message: str, code: str, retry_after: float = RETRY_AFTER_S) -> APIError:
    return APIError(
        503, message, type="service_unavailable", code=code, headers={"Retry-After": str(max(1, round(retry_after)))}
    )


# (error class, status, type, code): the first class an error is an instance of decides
_STATUSES: tuple[tuple[type[Exception], int, str, str | None], ...] = (
    (e.AuditUnavailableError, 503, "service_unavailable", "audit_unavailable"),
    (e.EngineDeadError, 503, "service_unavailable", "engine_stopped"),
    (e.AuditIntegrityError, 500, "server_error", "audit_refused"),
    (e.RequestFailedError, 500, "server_error", "request_failed"),
    (e.AdapterChangedError, 409, "invalid_request_error", "adapter_changed"),
    # a Hub repo (an adapter's lora_path): the Hub's own trouble is transient, the name's is the caller's
    (HubTimeoutError, 503, "service_unavailable", "hub_timeout"),
    (HubUnavailableError, 503, "service_unavailable", "hub_unavailable"),
    (HubNotFoundError, 404, "invalid_request_error", "hub_not_found"),
    (HubAccessError, 403, "invalid_request_error", "hub_access_denied"),
    (HubOfflineError, 400, "invalid_request_error", "hub_offline"),
    (HubTooLargeError, 413, "invalid_request_error", "hub_too_large"),
    (e.DuplicateRequestError, 409, "invalid_request_error", "duplicate_request_id"),
    (e.AdapterNotFoundError, 400, "invalid_request_error", "adapter_not_found"),
    (e.AdapterError, 400, "invalid_request_error", "invalid_adapter"),
    (e.LoRARequestConflictError, 400, "invalid_request_error", "adapter_conflict"),
    (e.TooManyLoRAsError, 400, "invalid_request_error", "too_many_adapters"),
    (e.UnknownRequestError, 404, "invalid_request_error", "not_found"),
    (e.PromptTooLongError, 400, "invalid_request_error", "context_length_exceeded"),
    (e.SamplingParamsError, 400, "invalid_request_error", "invalid_parameter"),
    (e.LoraLedgerError, 400, "invalid_request_error", "invalid_request"),
)


# a SamplingParams field -> the body field that sets it, where the two names differ
_BODY_FIELDS = {"extra_args": "vllm_xargs"}


def _param(exc: e.LoraLedgerError) -> str | None:
    """The body field an engine error is about, where one is to blame (vLLM's `param`)."""
    if isinstance(exc, e.SamplingParamsError) and exc.parameter is not None:
        return _BODY_FIELDS.get(exc.parameter, exc.parameter)
    if isinstance(exc, (e.AdapterError, e.TooManyLoRAsError, e.LoRARequestConflictError)):
        return "model"  # the adapter a body names by `model`
    if isinstance(exc, e.ChatTemplateError):
        return "messages"
    if isinstance(exc, e.PromptError):
        return "prompt"
    return None


def from_engine_error(exc: e.LoraLedgerError) -> APIError:
    """The OpenAI error for one of the engine's typed errors; its message is kept whole."""
    for kind, status, type_, code in _STATUSES:
        if isinstance(exc, kind):
            message = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
            headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
            return APIError(status, message, type=type_, code=code, headers=headers, param=_param(exc))
    raise AssertionError("LoraLedgerError is the last entry")  # pragma: no cover


def install_handlers(app) -> None:
    """Every error a route can end in becomes an OpenAI error object."""

    async def api_error(_request: Request, exc: APIError) -> Response:
        return exc.response()

    async def engine_error(_request: Request, exc: e.LoraLedgerError) -> Response:
        return from_engine_error(exc).response()

    async def invalid(_request: Request, exc: RequestValidationError) -> Response:
        problems = []
        for err in exc.errors()[:5]:
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {err.get('msg')}")
        param = ".".join(str(p) for p in exc.errors()[0].get("loc", ()) if p != "body") if exc.errors() else None
        return error_response(
            400,
            "invalid request: " + "; ".join(problems),
            type="invalid_request_error",
            code="invalid_parameter",
            param=param or None,
        )

    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), type=kind, headers=getattr(exc, "headers", None))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(e.LoraLedgerError, engine_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
