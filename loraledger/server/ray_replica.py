"""EngineReplica, the Ray Serve deployment whose replicas each run one engine behind the app of `loraledger serve`
(same routes, key checks, metrics, audit). The adapter a request names is Ray's multiplexed model id: loaded on first
use from the adapters folder and kept while it is among the replica's `max_cpu_loras` most recently used, as the
engine's host cache keeps it.

Imports Ray (the `ray` extra). No `from __future__ import annotations`: Ray inspects the deployment's signatures.
"""

import asyncio
from collections.abc import AsyncIterator

import msgspec
from ray import serve

from loraledger.errors import LoraLedgerError
from loraledger.server.app import build_app
from loraledger.server.asgi_relay import HttpBody, HttpRequest, HttpResponseStart, run_asgi
from loraledger.server.error_responses import APIError, from_engine_error
from loraledger.server.ray_config import AdapterFolder, RayServeArgs

ENGINE_START_TIMEOUT_S = 600.0


class ReplicaAdapter(msgspec.Struct, frozen=True):
    """What Ray's multiplexer keeps per loaded model id: the adapter as this replica registered it. The engine's own
    host cache (the same size, also LRU) holds its weights; Ray forgetting it only stops routing it here."""

    name: str
    lora_int_id: int


@serve.deployment(
    name="EngineReplica", max_ongoing_requests=256, graceful_shutdown_timeout_s=60, health_check_period_s=5
)
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
                raise APIError(
                    404,
                    f"The model `{name}` does not exist (no adapter folder of that name).",
                    code="model_not_found",
                    param="model",
                )
            try:
                lora = await models.load(name, str(path))  # registered, loaded, on record
            except APIError as exc:
                if exc.code != "adapter_exists":
                    raise
                lora = models.adapters[name]  # a concurrent request registered it first
        else:
            await self.state.engine.add_lora(lora)  # Ray routes it here again: back into the host cache
        return ReplicaAdapter(name=name, lora_int_id=lora.lora_int_id)

    async def relay(
        self, request: HttpRequest, adapter: str | None = None
    ) -> AsyncIterator[HttpResponseStart | HttpBody]:
        """Serve one relayed request. `adapter`: the adapter it names, which its caller may use (the Router checked
        the key); routed by affinity, it is also this call's multiplexed model id."""
        app = self.app
        try:
            if serve.get_multiplexed_model_id():
                await self._adapter(serve.get_multiplexed_model_id())
            elif adapter and adapter not in self.state.models.adapters:
                await self._load_adapter(
                    adapter
                )  # without affinity: registered here on first use, cached by the engine
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
