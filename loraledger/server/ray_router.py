"""Router, the Ray Serve deployment that is the HTTP entry: it reads the request's `model`, and for a caller whose
key may use that adapter calls the EngineReplica deployment with it as `multiplexed_model_id`, so Ray's router sends
it to a replica that already holds the adapter (or, when none does, to one holding the fewest); everything else goes
to any replica, whose app answers it exactly as `loraledger serve` would. The response is relayed as it comes,
server-sent events included.

Imports Ray (the `ray` extra). No `from __future__ import annotations`: FastAPI reads the route's annotations as
classes.
"""

from collections.abc import AsyncIterator

import msgspec
import structlog
from fastapi import FastAPI, Request
from ray import serve
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle
from starlette.responses import Response, StreamingResponse

from loraledger.server.asgi_relay import HttpRequest
from loraledger.server.auth import MAX_KEY_CHARS, Caller, KeyRing, bearer_key
from loraledger.server.error_responses import APIError, unavailable
from loraledger.server.ray_config import RayServeArgs

# routes whose JSON body names a model; the others never load an adapter
MODEL_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})
# adapters come from the shared folder: loading one into a single replica would leave the others without it
FOLDER_ROUTES = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


class NamedModel(msgspec.Struct):
    model: str | None = None


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
            return unavailable(
                "the replica serving this request stopped before it answered; retry", "replica_stopped"
            ).response()
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
            key = (
                self._keys.authenticate(presented)
                if presented is not None and len(presented) <= MAX_KEY_CHARS
                else None
            )
            if key is None or not Caller(
                tenant=key.tenant, key_id=key.key_id, role=key.role, adapters=key.adapters
            ).may_use(model):
                return None
        return model
