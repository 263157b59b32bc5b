"""The Ray Serve application: `serve run examples/ray_serve.yaml` (import path `loraledger.server.ray_app:app_builder`).

Two deployments. `EngineReplica`: each replica one engine behind the app of `loraledger serve` (same routes, key
checks, metrics, audit), the adapter named by `model` being Ray's multiplexed model id, loaded on first use from
the adapters folder and kept in the replica's host cache (`max_num_models_per_replica` = the engine's
max_cpu_loras). `Router`: the HTTP ingress; it reads the request's `model`, and for a caller whose key may use that
adapter calls the replicas' handle with it as `multiplexed_model_id`, so Ray's router sends it to a replica that
already holds the adapter (or, when none does, to one holding the fewest), and relays the response, streams
included. Everything else (missing or bad keys, the base model, /health, /metrics) goes to any replica, whose app
answers it exactly as `loraledger serve` would.

Importing this module imports Ray (the `ray` extra); the engine and `loraledger serve` never do. (No `from __future__
import annotations` here: FastAPI reads the Router's route annotations as classes.)
"""

import asyncio
from collections.abc import AsyncIterator

import msgspec
import structlog
from fastapi import FastAPI, Request
from ray import serve
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle
from starlette.responses import Response, StreamingResponse

from loraledger.errors import LoraLedgerError
from loraledger.server.app import build_app
from loraledger.server.asgi_relay import HttpBody, HttpRequest, HttpResponseStart, run_asgi
from loraledger.server.auth import MAX_KEY_CHARS, Caller, KeyRing, bearer_key
from loraledger.server.errors import APIError, from_engine_error, unavailable
from loraledger.server.ray_config import AdapterFolder, RayServeArgs

# routes whose JSON body names a model; the others never load an adapter
MODEL_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})
# adapters come from the shared folder: loading one into a single replica would leave the others without it
FOLDER_ROUTES = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
ENGINE_START_TIMEOUT_S = 600.0


class NamedModel(msgspec.Struct):
    model: str | None = None


class ReplicaAdapter(msgspec.Struct, frozen=True):
    """What Ray's multiplexer keeps per loaded model id: the adapter as this replica registered it. The engine's own
    host cache (the same size, also LRU) holds its weights; Ray forgetting it only stops routing it here."""

    name: str
    lora_int_id: int


@serve.deployment(name="EngineReplica", max_ongoing_requests=256, graceful_shutdown_timeout_s=60, health_check_period_s=5)
class EngineReplica:
    async def __init__(self, args: RayServeArgs) -> None:
        self._folder = AdapterFolder(args.adapters_dir)
        self.app = build_app(args.server_config())
        self.state = self.app.state.server
        self._stop = asyncio.Event()
        ready = asyncio.Event()
        self._host = asyncio.create_task(self._run(ready))
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait({self._host, waiter}, timeout=ENGINE_START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        if not ready.is_set():
            waiter.cancel()
            if self._host.done():
                self._host.result()  # the engine's own error (bad model folder, audit store unreachable...)
            raise RuntimeError(f"the engine did not start within {ENGINE_START_TIMEOUT_S:.0f} s")

        async def load_adapter(model_id: str) -> ReplicaAdapter:
            return await self._load_adapter(model_id)

        # Ray's LRU of model ids per replica, as large as the engine's host cache of adapters
        self._adapter = serve.multiplexed(max_num_models_per_replica=args.adapters_per_replica)(load_adapter)

    async def _run(self, ready: asyncio.Event) -> None:
        """The app's lifespan (the engine started, recovery run, then drained and stopped) in one task of its own."""
        async with self.app.router.lifespan_context(self.app):
            ready.set()
            await self._stop.wait()

    async def _load_adapter(self, name: str) -> ReplicaAdapter:
        models = self.state.models
        lora = models.adapters.get(name)
        if lora is None:
            path = self._folder.path(name)
            if path is None:
                raise APIError(404, f"The model `{name}` does not exist (no adapter folder of that name).", code="model_not_found", param="model")
            try:
                lora = await models.load(name, str(path))  # registered, loaded, on record
            except APIError as exc:
                if exc.code != "adapter_exists":
                    raise
                lora = models.adapters[name]  # a concurrent request registered it first
        else:
            await self.state.engine.add_lora(lora)  # Ray routes it here again: back into the host cache
        return ReplicaAdapter(name=name, lora_int_id=lora.lora_int_id)

    async def relay(self, request: HttpRequest, adapter: str | None = None) -> AsyncIterator[HttpResponseStart | HttpBody]:
        """Serve one relayed request. `adapter`: the adapter it names, which its caller may use (the Router checked
        the key); routed by affinity, it is also this call's multiplexed model id."""
        app = self.app
        try:
            if serve.get_multiplexed_model_id():
                await self._adapter(serve.get_multiplexed_model_id())
            elif adapter and adapter not in self.state.models.adapters:
                await self._load_adapter(adapter)  # without affinity: registered here on first use, cached by the engine
        except APIError as exc:
            app = exc.response()
        except LoraLedgerError as exc:
            app = from_engine_error(exc).response()
        async for message in run_asgi(app, request):
            yield message

    async def check_health(self) -> None:
        """Ray replaces a replica whose engine has stopped (device lost, audit store corrupt)."""
        if self._host.done() or self.state.engine_dead():
            raise RuntimeError("the replica's engine has stopped")

    async def __del__(self) -> None:
        """Ray's graceful shutdown: new requests get 503, running ones finish, the audit log is flushed."""
        self.state.begin_drain()
        await self.state.wait_idle(self.state.config.shutdown_grace_seconds)
        self._stop.set()
        await self._host


async def _bodies(stream) -> AsyncIterator[bytes]:
    """The relayed body; when the client goes away first, the replica's call is cancelled (its requests aborted)."""
    finished = False
    try:
        async for message in stream:
            yield message.data
        finished = True
    finally:
        if not finished:
            stream.cancel()


router_app = FastAPI(title="loraledger", docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment(name="Router", max_ongoing_requests=1024)
@serve.ingress(router_app)
class Router:
    def __init__(self, replicas: DeploymentHandle, args: RayServeArgs) -> None:
        config = args.server_config()
        self._replicas = replicas
        self._keys = KeyRing(config.api_keys_file) if config.api_keys_file is not None else None
        self._base_names = frozenset(config.served_model_name)
        self._max_body = config.max_body_bytes
        self._affinity = args.adapter_affinity
        self._log = structlog.get_logger().bind(actor="router")

    @router_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def forward(self, request: Request) -> Response:
        try:
            if request.url.path in FOLDER_ROUTES:
                raise APIError(
                    400, "a Ray Serve deployment serves the adapters of its adapters folder: put the adapter's folder "
                    "there and name it in requests; it loads on first use", code="adapters_from_folder",
                )  # fmt: skip
            body = await self._body(request)
        except APIError as exc:
            return exc.response()
        relayed = HttpRequest(
            method=request.method, path=request.url.path, query_string=request.url.query.encode("latin-1"),
            headers=tuple(request.headers.raw), body=body, client=tuple(request.client) if request.client else None,
        )  # fmt: skip
        adapter = self._adapter_for(request, body)
        if adapter and self._affinity:
            handle = self._replicas.options(stream=True, multiplexed_model_id=adapter)
        else:
            handle = self._replicas.options(stream=True)
        stream = handle.relay.remote(relayed, adapter)
        try:
            start = await stream.__anext__()
        except (RayError, StopAsyncIteration) as exc:
            self._log.error("no replica answered", error=f"{type(exc).__name__}: {exc}", route=request.url.path)
            return unavailable("the replica serving this request stopped before it answered; retry", "replica_stopped").response()
        response = StreamingResponse(_bodies(stream), status_code=start.status)
        response.raw_headers = list(start.headers)
        return response

    async def _body(self, request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self._max_body):
            raise APIError(413, f"the request body is over {self._max_body} bytes", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self._max_body:
                raise APIError(413, f"the request body is over {self._max_body} bytes", code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def _adapter_for(self, request: Request, body: bytes) -> str | None:
        """The adapter to route on: the body's `model` when it is an adapter the caller's key may use. Anything else
        routes anywhere, and the replica gives the same answer (401, 403 on record, 404) as `loraledger serve`."""
        if request.method != "POST" or request.url.path not in MODEL_ROUTES:
            return None
        try:
            model = msgspec.json.decode(body, type=NamedModel).model
        except msgspec.DecodeError:
            return None
        if not model or model in self._base_names:
            return None
        if self._keys is not None:
            presented = bearer_key(request)
            key = self._keys.authenticate(presented) if presented is not None and len(presented) <= MAX_KEY_CHARS else None
            if key is None or not Caller(tenant=key.tenant, key_id=key.key_id, role=key.role, adapters=key.adapters).may_use(model):
                return None
        return model


def app_builder(args: dict) -> serve.Application:
    """The application `serve run` builds from the config file's `args` (RayServeArgs); Ray's part of the file
    (num_replicas, autoscaling_config, ray_actor_options) configures the two deployments by name."""
    parsed = RayServeArgs.parse(args)
    return Router.bind(EngineReplica.bind(parsed), parsed)
