"""build_app: the FastAPI app (routes, key checks, metrics, error objects) and ServerState; the lifespan starts the
engine and drains it, so SIGTERM under uvicorn and a test's shutdown run the same path."""

from __future__ import annotations

import asyncio
import signal
import time
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import structlog
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from loraledger.engine_client import EngineClient
from loraledger.server.auth import KeyRing, RateLimiter, presented_key
from loraledger.server.error_responses import APIError, install_handlers, unavailable
from loraledger.server.metrics import ServerMetrics
from loraledger.server.request_extras import MAX_CALLER_ID_CHARS
from loraledger.server.server_config import ServerConfig
from loraledger.server.signals import SignalInbox

GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
AUTHENTICATED_ROUTES = GENERATION_ROUTES | {
    "/v1/models", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/tokenize", "/detokenize", "/metrics",
}  # fmt: skip
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
SLOW_BODY_SECONDS = 0.5  # a body not all there this long after its headers counts in the slow clients' budget
KEYS_RELOAD_SECONDS = 10.0
READY_CHECK_SECONDS = 2.0
CUT_ANSWER_SECONDS = 1.0  # sending the error object of a request cut at shutdown (a client not reading: dropped)


class ServerState:
    """Everything the routes share: the engine, the served models, the keys, the metrics, and the drain state."""

    def __init__(self, config: ServerConfig, engine: EngineClient | None = None) -> None:
        from loraledger.evidence.otel import RequestTracing
        from loraledger.server.serving_chat import OpenAIServingChat
        from loraledger.server.serving_completion import OpenAIServingCompletion
        from loraledger.server.serving_evidence import ServingEvidence
        from loraledger.server.serving_models import OpenAIServingModels
        from loraledger.server.serving_responses import OpenAIServingResponses
        from loraledger.server.serving_tokenization import OpenAIServingTokenization

        self.config = config
        self.engine: EngineClient | None = engine  # None: the lifespan starts one from config.engine_args
        self.keys: KeyRing | None = KeyRing(config.api_keys_file) if config.api_keys_file is not None else None
        self.limiter = RateLimiter()
        self.metrics = ServerMetrics(config.model_name)
        self.started = int(time.time())
        self.models = OpenAIServingModels(self)
        self.completion = OpenAIServingCompletion(self)
        self.chat = OpenAIServingChat(self)
        self.responses = OpenAIServingResponses(self.chat)  # the Responses API, served through the chat route
        self.tokenization = OpenAIServingTokenization(self)
        self.evidence = ServingEvidence(self)  # GET /evidence/...: checkpoints, proofs, receipts
        self.tracing = RequestTracing()  # a span per request where OpenTelemetry is installed (the otel extra)
        self.limits = config.limits
        self._sandbox = None
        self.body_readers = 0  # requests whose body is still arriving
        self.draining = False
        self._drain_logged = False
        self.signals = SignalInbox()
        self.in_flight = 0
        self._idle = anyio.Event()
        self._idle.set()
        self._log = structlog.get_logger().bind(actor="server")

    def template_sandbox(self):
        """The worker process that renders requests' own chat templates (made on first use)."""
        if self._sandbox is None:
            from loraledger.server.template_sandbox import TemplateSandbox

            self._sandbox = TemplateSandbox(
                seconds=self.limits.chat_template_seconds, max_chars=self.limits.max_rendered_chars
            )
        return self._sandbox

    def close(self) -> None:
        self.evidence.close()
        if self._sandbox is not None:
            self._sandbox.close()

    async def not_ready(self) -> str | None:
        """Why this server should get no traffic now (None: ready): draining, the engine stopped, or the audit store
        unreachable (requests would be refused until it is back)."""
        if self.draining:
            return "shutting down"
        if self.engine_dead():
            return "the engine has stopped"
        with anyio.move_on_after(READY_CHECK_SECONDS):
            metrics = await self.engine.get_metrics()
            if metrics.audit_enabled and metrics.audit_store_down:
                return "the audit store is unreachable; requests are refused until it answers"
            return None
        return "the engine did not answer the readiness check in time"

    def engine_dead(self) -> bool:
        return self.engine is None or not self.engine.is_running

    def mark_draining(self) -> None:
        """Shutdown has begun: new requests get 503, running ones go on. Only sets a flag, so a signal handler may
        call it (the log line comes from begin_drain, in normal code)."""
        self.draining = True

    def begin_drain(self) -> None:
        """mark_draining, and say so in the log (once)."""
        self.draining = True
        if not self._drain_logged:
            self._drain_logged = True
            self._log.info(
                "shutting down: no new requests; running requests get the grace period",
                grace_seconds=self.config.shutdown_grace_seconds,
            )

    def reload_keys(self) -> None:
        if self.keys is not None:
            self.keys.reload()

    async def on_signal(self, signum: int) -> None:
        """A signal's work, run by the SignalInbox's task: SIGHUP reloads the keys file (off the event loop, under a
        deadline), SIGTERM and SIGINT log the drain that uvicorn's handler started."""
        try:
            if signum == getattr(signal, "SIGHUP", None):
                with anyio.move_on_after(KEYS_RELOAD_SECONDS) as scope:
                    await anyio.to_thread.run_sync(self.reload_keys, abandon_on_cancel=True)
                if scope.cancelled_caught:
                    self._log.error(
                        "keys file not reloaded within the deadline; the previous keys stay in force",
                        seconds=KEYS_RELOAD_SECONDS,
                    )
            elif signum in (signal.SIGTERM, signal.SIGINT):
                self.begin_drain()
        except Exception as exc:  # a signal's work never stops the server
            self._log.error("signal not handled", signal=signum, error=f"{type(exc).__name__}: {exc}")

    async def startup(self) -> None:
        for module in self.config.lora_modules:
            await self.models.load(module.name, module.path)

    async def wait_idle(self, timeout: float) -> None:
        """Wait until no request is in flight (requests cancelled at the end of the grace period are still recording
        their abort)."""
        with anyio.move_on_after(timeout):
            while self.in_flight:
                self._idle = anyio.Event()
                await self._idle.wait()

    def enter(self) -> None:
        self.in_flight += 1
        self.metrics.engine.in_flight = self.in_flight

    def leave(self) -> None:
        self.in_flight -= 1
        self.metrics.engine.in_flight = self.in_flight
        if self.in_flight == 0:
            self._idle.set()

    async def render_metrics(self) -> Response:
        collector = self.metrics.engine
        if not self.engine_dead():
            try:
                collector.latest = await self.engine.get_metrics()
            except Exception as exc:  # a scrape never fails on the engine's account: its last figures stay
                self._log.warning("engine metrics not read", error=f"{type(exc).__name__}: {exc}")
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


class ClientNotReading(Exception):
    """A write of the answer did not go out within the send deadline: the client stopped reading."""


def _bounded(send: Send, seconds: float) -> Send:
    """send, each message within `seconds` (a client that stops reading would otherwise hold its request, and its
    place in the server's capacity, for good); ClientNotReading past it. A message not sent is not half-sent:
    uvicorn waits for room before it writes."""

    async def bounded(message) -> None:
        with anyio.move_on_after(seconds) as scope:
            await send(message)
        if scope.cancelled_caught:
            raise ClientNotReading(f"the client read nothing of its answer for {seconds:g} s")

    return bounded


def _only(exc: BaseException, kind: type[BaseException]) -> bool:
    """exc is a `kind`, or a group of nothing else (a stream's task groups wrap what its writes raised)."""
    inner = getattr(exc, "exceptions", None)  # a BaseExceptionGroup (Python 3.11+, or anyio's backport)
    if isinstance(inner, tuple) and inner:
        return all(_only(e, kind) for e in inner)
    return isinstance(exc, kind)


class ServerMiddleware:
    """Per request, before any route: the caller's X-Request-Id (checked, echoed, logged), the log context, the key
    (a route that needs one answers 401 before reading the body), then the body, read whole under the size limit and
    the body deadline within the slow clients' budget; only then, for generation routes, the drain and capacity
    checks and the in-flight count. A caller without a key, or one slow to send its body, never holds a slot that
    authenticated requests need."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.state
        bounded_send = _bounded(send, state.limits.send_seconds)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        caller_id = headers.get("x-request-id")
        path = scope.get("path")
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(
            request_id=None, tenant=None, adapter=None, caller_request_id=None, route=path
        )
        generation = path in GENERATION_ROUTES
        entered = False
        try:
            if caller_id is not None and not (
                0 < len(caller_id) <= MAX_CALLER_ID_CHARS and caller_id.isprintable() and caller_id.isascii()
            ):
                raise APIError(
                    400,
                    f"X-Request-Id must be 1-{MAX_CALLER_ID_CHARS} printable ASCII characters",
                    param="X-Request-Id",
                )
            structlog.contextvars.bind_contextvars(caller_request_id=caller_id)
            limit = state.config.max_body_bytes
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > limit):
                raise APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
            if path in AUTHENTICATED_ROUTES:
                presented_key(state, headers.get("authorization"))
            if generation and state.draining:
                raise unavailable("the server is shutting down; retry on another replica", "shutting_down")
            body = await self._read_body(scope, receive, limit) if scope.get("method") in BODY_METHODS else None
            if generation:
                if state.draining:
                    raise unavailable("the server is shutting down; retry on another replica", "shutting_down")
                if state.in_flight >= state.config.pending_limit:
                    raise unavailable(
                        f"the server is over capacity ({state.in_flight} requests in flight); retry shortly",
                        "over_capacity",
                    )
                state.enter()
                entered = True
        except APIError as exc:
            response = exc.response()
            if caller_id is not None and exc.param != "X-Request-Id":
                response.headers["x-request-id"] = caller_id
            await response(scope, receive, bounded_send)
            return

        async def replay_receive():
            nonlocal body
            if body is not None:
                message, body = {"type": "http.request", "body": body, "more_body": False}, None
                return message
            return await receive()  # after the body: a disconnect, when the client goes

        started = False

        async def echoing_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if caller_id is not None:
                    message = {
                        **message,
                        "headers": [*message.get("headers", ()), (b"x-request-id", caller_id.encode("latin-1"))],
                    }
            await bounded_send(message)

        try:
            await self.app(scope, replay_receive, echoing_send)
        except anyio.get_cancelled_exc_class():
            # uvicorn cancels what is still running when the grace period ends; its own answer would be a plain-text
            # 500. A request that has not answered yet gets an OpenAI error object instead (the cancellation is not
            # passed on: the task ends here, its answer sent)
            if started or not state.draining:
                raise
            await self._cut_at_shutdown(scope, receive, echoing_send)
        except Exception as exc:
            if not _only(exc, ClientNotReading):
                raise
            # the connection is closed (its answer incomplete); a stream's requests were aborted on the way out
            structlog.get_logger().bind(actor="server").warning(
                "client cut off: it stopped reading its answer", send_seconds=state.limits.send_seconds
            )
        finally:
            if entered:
                state.leave()

    async def _cut_at_shutdown(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        if task is not None and hasattr(task, "uncancel"):  # Python 3.11+: the cancellation is handled here
            task.uncancel()
        grace = self.state.config.shutdown_grace_seconds
        structlog.get_logger().bind(actor="server").warning(
            "request cut at shutdown: the grace period ended before it answered", grace_seconds=grace
        )
        exc = unavailable(
            f"the server is shutting down and this request did not finish within the grace period ({grace:g} s): its "
            "output is not on record and is not released (it is recorded as aborted, or as interrupted when the audit "
            "store did not answer); retry on another replica",
            "shutting_down",
        )
        with anyio.move_on_after(CUT_ANSWER_SECONDS, shield=True):
            await exc.response()(scope, receive, send)

    async def _read_body(self, scope: Scope, receive: Receive, limit: int) -> bytes:
        """The whole body, within the size limit and the body deadline. A body that is not all there at once (the
        usual case for a small one: it came with the headers) waits in the slow clients' budget."""
        state, limits = self.state, self.state.limits
        chunks: list[bytes] = []
        size = 0
        counted = False
        try:
            with anyio.move_on_after(limits.body_seconds):
                while True:
                    message = None
                    if not counted:
                        with anyio.move_on_after(SLOW_BODY_SECONDS):  # cancelling a receive loses nothing
                            message = await receive()
                        if message is None or message.get("more_body", False):
                            if state.body_readers >= limits.max_body_readers:
                                raise unavailable(
                                    f"{state.body_readers} requests are still sending their bodies; retry shortly",
                                    "too_many_slow_clients",
                                )
                            state.body_readers += 1
                            counted = True
                    if message is None:
                        message = await receive()
                    if message["type"] == "http.disconnect":
                        raise APIError(400, "the client went away before its body arrived", code="client_gone")
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
            raise APIError(
                408, f"the request body did not arrive within {limits.body_seconds:g} s", code="request_timeout"
            )
        finally:
            if counted:
                state.body_readers -= 1


def build_app(config: ServerConfig, *, engine: EngineClient | None = None) -> FastAPI:
    """The server's FastAPI app. Without `engine`, its lifespan starts an AsyncEngine from config.engine_args and
    stops it (flushing the audit writer) at shutdown; with one (already running: a host that owns its engine, as a
    Ray Serve replica does), it serves that engine and leaves its life to the host."""
    from loraledger.server.api_router import router
    from loraledger.server.evidence_router import router as evidence_router

    state = ServerState(config, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with AsyncExitStack() as stack:
            if state.engine is None:
                from loraledger import AsyncEngine

                state.engine = await stack.enter_async_context(AsyncEngine.from_engine_args(config.engine_args))
            await state.startup()
            state._log.info(
                "serving",
                model=config.model_name,
                adapters=sorted(state.models.adapters),
                keys=len(state.keys) if state.keys else 0,
            )
            signals = await stack.enter_async_context(anyio.create_task_group())
            signals.start_soon(state.signals.serve, state.on_signal)
            stack.callback(signals.cancel_scope.cancel)
            try:
                yield
            finally:
                state.begin_drain()
                # uvicorn has waited for running requests (the grace period) and cancelled the rest: wait for their
                # aborts to be on record, then the engine stops and flushes the audit writer
                await state.wait_idle(config.engine_args.audit_timeout + 5)
                state.close()
        state._log.info("stopped")

    app = FastAPI(
        title="loraledger",
        lifespan=lifespan,
        root_path=config.root_path,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.server = state
    install_handlers(app)
    app.include_router(router)
    app.include_router(evidence_router)
    app.add_middleware(ServerMiddleware, state=state)
    return app
